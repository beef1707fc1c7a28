"""Sampling's edge cases: a temperature too small to divide by, and logits a damaged model makes."""
import pytest
import torch
import torch.nn as nn

from minigpt.sampling import generate


class FixedLogits(nn.Module):
    """ids -> the same logits row at every position (a model whose numbers we choose)."""

    def __init__(self, row: list[float]):
        super().__init__()
        self.row = torch.tensor(row)
        self.config = type("C", (), {"block_size": 8})()

    def forward(self, idx):
        return self.row.expand(idx.size(0), idx.size(1), -1).clone()


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    model = FixedLogits([0.0, 3.0, 1.0])
    for t in (1e-300, 1e-45, 1e-38):
        out = generate(model, torch.zeros(2, 1, dtype=torch.long), 3, temperature=t,
                       generator=torch.Generator().manual_seed(0))
        assert out[:, 1:].eq(1).all(), t


@pytest.mark.parametrize("row", [[0.0, float("inf"), 1.0], [float("nan"), 0.0, 1.0], [float("-inf")] * 3])
def test_logits_no_token_can_be_drawn_from_are_refused(row):
    with pytest.raises(FloatingPointError, match="logits are not finite"):
        generate(FixedLogits(row), torch.zeros(1, 1, dtype=torch.long), 2, temperature=0.8)


def test_minus_inf_at_some_tokens_only_never_draws_them():
    out = generate(FixedLogits([float("-inf"), 0.0, 0.0]), torch.zeros(4, 1, dtype=torch.long), 20,
                   temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert not out[:, 1:].eq(0).any()

"""train() on batches it does not draw itself (e.g. padded instruction examples with masked targets), and the
loss each torchrun rank uses so that masked shards average to the global batch's gradient."""
import pytest
import torch

from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import TrainConfig, counted_loss, lm_loss, run_identity, train

IGNORE = -100


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8))


def masked_batch(batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (x, y) whose rows count different numbers of targets (the rest -100), as padded examples do."""
    x = torch.randint(0, 11, (batch_size, 8), generator=gen)
    y = torch.randint(0, 11, (batch_size, 8), generator=gen)
    counted = torch.randint(1, 9, (batch_size, 1), generator=gen)
    return x, y.masked_fill(torch.arange(8) >= counted, IGNORE)


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_counted_loss_over_uneven_shards_averages_to_the_global_gradient():
    model = tiny()
    x, y = masked_batch(4, torch.Generator().manual_seed(1))
    y[2:, 1:] = IGNORE  # the second shard counts far fewer targets than the first
    whole = grads(model, lm_loss(model, x, y))
    n = int((y != IGNORE).sum())
    shards = [grads(model, counted_loss(n, 2)(model, x[s], y[s])) for s in (slice(0, 2), slice(2, 4))]
    for g, a, b in zip(whole, *shards):
        assert torch.allclose(g, (a + b) / 2, atol=1e-6)
    naive = [grads(model, lm_loss(model, x[s], y[s])) for s in (slice(0, 2), slice(2, 4))]
    assert not all(torch.allclose(g, (a + b) / 2, atol=1e-6) for g, a, b in zip(whole, *naive))
    with torch.no_grad():  # the ranks' mean loss is the global batch's mean loss
        losses = [counted_loss(n, 2)(model, x[s], y[s]) for s in (slice(0, 2), slice(2, 4))]
        assert torch.isclose(sum(losses) / 2, lm_loss(model, x, y), atol=1e-6)


def test_train_draws_from_batches_and_validates_with_val_loss(tmp_path):
    cfg = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=3, checkpoint_every=3)
    calls = []

    def val_loss(model):
        calls.append(model.training)
        return 1.5

    identity = {"train_examples_sha256": "a", "val_examples_sha256": "b"}
    result = train(tiny(), None, None, cfg, out_dir=tmp_path, progress=False, batches=masked_batch, val_loss=val_loss,
                   data_identity=identity)
    assert result.final_val_loss == 1.5 and len(calls) == 2
    assert all(r["train_loss"] > 0 for r in result.history)
    resumed = train(tiny(), None, None, cfg, out_dir=tmp_path, progress=False, resume=True, batches=masked_batch,
                    val_loss=val_loss, data_identity=identity, log=lambda *_: None)
    assert resumed.history == result.history  # nothing left to do: the finished run's rows
    assert run_identity(cfg, None, None, None, identity)["fingerprint"] == identity


def test_train_needs_ids_or_the_three_callables():
    cfg = TrainConfig(steps=1, batch_size=2)
    with pytest.raises(ValueError, match="train_ids and val_ids"):
        train(tiny(), None, None, cfg, progress=False, batches=masked_batch, val_loss=lambda m: 0.0)

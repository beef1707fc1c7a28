"""minikernels.large_output: a frozen Linear's large output in huge pages, bit for bit F.linear's."""
import pytest
import torch
import torch.nn.functional as F

from minikernels import large_output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_input_gradient_are_f_linear_bit_for_bit(monkeypatch, dtype, bias):
    monkeypatch.setattr(large_output, "FRESH_MAPPING_BYTES", 1)  # every output takes the path
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype) if bias else None
    x = torch.randn(2, 9, 64, generator=g).to(dtype)
    grad_y = torch.randn(2, 9, 300, generator=g).to(dtype)
    assert large_output.takes(x, w, b)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = large_output.frozen_linear(x1, w, b), F.linear(x2, w, b)
    assert y1.shape == y2.shape and y1.dtype == dtype and torch.equal(y1, y2)
    y1.backward(grad_y)
    y2.backward(grad_y)
    assert torch.equal(x1.grad, x2.grad)


def test_it_keeps_what_f_linear_keeps(monkeypatch):
    monkeypatch.setattr(large_output, "FRESH_MAPPING_BYTES", 1)
    w, x = torch.randn(8, 4), torch.randn(3, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        large_output.frozen_linear(x, w)
    assert len(saved) == 1 and saved[0] is w  # the weight only (a parameter: the planner's weights bucket)


def test_small_outputs_trainable_weights_and_autocast_take_f_linear():
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert not large_output.takes(x, w, None)  # 96 bytes of output
    big_x = torch.empty(1 << 20, 4)  # 1 M rows x 8 outputs x 4 bytes: 32 MiB
    assert large_output.takes(big_x, w, None)
    assert not large_output.takes(big_x, w.clone().requires_grad_(), None)
    assert not large_output.takes(big_x, w, torch.zeros(8, requires_grad=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not large_output.takes(big_x, w, None)

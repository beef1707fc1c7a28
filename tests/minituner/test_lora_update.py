"""LoRAUpdate, the in-place LoRA path of LoRALinear: exact gradients, and the same results as the plain formula."""
import copy

import pytest
import torch
import torch.nn as nn

from miniquant import QuantizedLinear
from minituner.lora import LoRALinear, LoRAUpdate


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the largest magnitude (sums of 64 products)."""
    return bool((a - b).abs().max() <= 1e-6 * (1 + b.abs().max()))


def test_gradcheck_every_input():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in [(6, 7), (6, 5), (3, 5), (7, 3)]]
    assert torch.autograd.gradcheck(lambda y, h, A, B: LoRAUpdate.apply(y.clone(), h, A, B, 0.7), args)


@pytest.mark.parametrize("base_kind", ["linear", "nf4"])
@pytest.mark.parametrize("shape", [(2, 3, 64), (5, 64), (64,)], ids=str)
def test_layer_matches_the_formula_with_gradients(base_kind, shape):
    torch.manual_seed(1)
    linear = nn.Linear(64, 48)
    base = linear if base_kind == "linear" else QuantizedLinear.from_linear(linear, "nf4_per_group_64")
    layer = LoRALinear(copy.deepcopy(base), r=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    A = layer.lora_A["default"].weight.detach().clone().requires_grad_()
    B = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    x = torch.randn(shape, requires_grad=True)
    y = layer(x)
    w = base.weight if base_kind == "linear" else base.dequantize()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = nn.functional.linear(x_ref, w.detach(), base.bias) + 2.0 * (x_ref @ A.t() @ B.t())
    assert y.shape == y_ref.shape and close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert close(x.grad, x_ref.grad)
    assert close(layer.lora_A["default"].weight.grad, A.grad)
    assert close(layer.lora_B["default"].weight.grad, B.grad)


def test_two_active_adapters_and_a_frozen_input():
    torch.manual_seed(2)
    layer = LoRALinear(nn.Linear(32, 16), r=2, alpha=4.0)
    layer.add_adapter("second", r=3, alpha=3.0)
    layer.active_adapters = {"default": 1.0, "second": 0.5}
    with torch.no_grad():
        for name in ("default", "second"):
            layer.lora_B[name].weight.normal_()
    x = torch.randn(4, 32)  # no grad needed for x: the first layer of a model
    y = layer(x)
    expected = layer.base_layer(x) + layer.delta_weight().matmul(x.t()).t()
    assert close(y, expected)
    y.sum().backward()
    assert all(layer.lora_B[n].weight.grad is not None for n in ("default", "second"))

"""minituner.lora_product: one adapter on a frozen base as one Function under bf16 compute, the same numbers as the
two pieces it replaces (LoRAUpdate after the base), and where it is not taken."""
import copy

import pytest
import torch
import torch.nn as nn

from miniquant import QuantizedLinear
from minituner import lora_product
from minituner.lora import LoRALinear
from minituner.precision import use_bf16_compute

BF16 = torch.bfloat16


def layer_in_bf16(base_kind: str, bias: bool = True) -> nn.Module:
    """A LoRALinear (r 4) over an nn.Linear or NF4 base, B nonzero, in bf16 compute, wrapped so it can be swapped."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    base = linear if base_kind == "linear" else QuantizedLinear.from_linear(linear, "nf4_per_group_64")
    model = nn.Sequential(LoRALinear(base, r=4, alpha=8.0))
    with torch.no_grad():
        model[0].lora_B["default"].weight.normal_(0, 0.1)
    model[0].base_layer.requires_grad_(False)
    return use_bf16_compute(model)


def graph_names(t: torch.Tensor) -> set[str]:
    """The names of every autograd node behind t."""
    names, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in names:
            names.add(type(fn).__name__)
            todo += [f for f, _ in fn.next_functions]
    return names


def fused(t: torch.Tensor) -> bool:
    return any("LoRAProduct" in n for n in graph_names(t))


def run(model: nn.Module, x: torch.Tensor, on: bool, monkeypatch) -> tuple:
    """(output, grad of x, grad of A, grad of B, whether it was fused) with the fused path on or off."""
    import minituner.lora as lora

    monkeypatch.setattr(lora, "fused_fits", lora_product.fused_fits if on else (lambda *a: False))
    model = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    name = fused(y)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype))
    layer = model[0]
    return y.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad, name


@pytest.mark.parametrize("base_kind", ["linear", "nf4"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_same_numbers_as_the_two_pieces(base_kind, bias, monkeypatch):
    """Output and the masters' gradients bit for bit; x's gradient rounds the adapter's share once instead of
    twice: on average as close to the fp32 reference as the two pieces' or closer, each about a unit apart."""
    model = layer_in_bf16(base_kind, bias)
    x = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    y, gx, gA, gB, name = run(model, x, True, monkeypatch)
    y0, gx0, gA0, gB0, name0 = run(model, x, False, monkeypatch)
    assert name and not name0
    assert torch.equal(y, y0) and torch.equal(gA, gA0) and torch.equal(gB, gB0)
    assert gA.dtype == gB.dtype == torch.float32  # the masters' dtype
    # the fp32 reference of x's gradient: g·(W + s·B·A)
    layer = model[0]
    w = (layer.base_layer.weight if base_kind == "linear" else layer.base_layer.dequantize(BF16)).float()
    delta = 2.0 * layer.lora_B["default"].weight.to(BF16).float() @ layer.lora_A["default"].weight.to(BF16).float()
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(BF16).float()
    with torch.no_grad():
        ref = g @ (w + delta)
    err, err0 = (gx.float() - ref).abs(), (gx0.float() - ref).abs()
    assert err.mean() <= err0.mean()
    # each value a bf16 unit or so apart (of itself, or of the largest for values near 0, where the two halves cancel)
    assert torch.allclose(gx.float(), gx0.float(), rtol=2**-7, atol=2**-8 * gx0.float().abs().max().item())


def test_a_frozen_input_gets_no_gradient_and_the_nf4_base_is_not_dequantized_again(monkeypatch):
    model = layer_in_bf16("nf4")
    base = model[0].base_layer
    calls = []
    real = type(base).dequantize_from
    monkeypatch.setattr(type(base), "dequantize_from", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    y = model(torch.randn(3, 64).to(BF16))  # the first layer of a model: its input needs no gradient
    assert fused(y)
    y.float().sum().backward()
    assert len(calls) == 1  # forward only
    assert model[0].lora_A["default"].weight.grad is not None and model[0].lora_B["default"].weight.grad is not None


def test_changing_the_nf4_codes_between_forward_and_backward_raises():
    model = layer_in_bf16("nf4")
    y = model(torch.randn(3, 64).to(BF16).requires_grad_())
    with torch.no_grad():
        model[0].base_layer.weight_packed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def _not_fused(model: nn.Module, x: torch.Tensor) -> bool:
    return not fused(model(x))


def test_not_taken_in_fp32_with_two_adapters_dropout_or_a_hooked_base():
    torch.manual_seed(0)
    fp32 = nn.Sequential(LoRALinear(nn.Linear(64, 48), r=4))
    fp32[0].base_layer.requires_grad_(False)
    assert _not_fused(fp32, torch.randn(3, 64))

    x = torch.randn(3, 64).to(BF16)
    two = layer_in_bf16("linear")
    two[0].add_adapter("second", r=2, alpha=2.0)
    two[0].active_adapters = {"default": 1.0, "second": 1.0}
    assert _not_fused(two, x)

    dropout = layer_in_bf16("nf4")
    dropout[0].lora_dropout["default"] = nn.Dropout(0.1)
    assert _not_fused(dropout.train(), x)
    assert not _not_fused(dropout.eval(), x)  # dropout off in eval: the fused path again

    hooked = layer_in_bf16("nf4")
    seen = []
    hooked[0].base_layer.register_forward_hook(lambda m, a, out: seen.append(out))
    assert _not_fused(hooked, x) and len(seen) == 1  # the base's hook still runs


def test_a_model_step_in_bf16_takes_it_for_every_adapted_linear():
    from minigpt.model import GPTConfig, MiniGPT
    from minigpt.train import lm_loss
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    torch.manual_seed(0)
    model = build_for_training(MiniGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)),
                               "qlora", LoRAConfig(r=4, alpha=8.0), device="cpu", precision="bf16",
                               allow_slow_bf16=True)
    applied = []
    real = lora_product.LoRAProduct.apply
    lora_product.LoRAProduct.apply = lambda *a: applied.append(1) or real(*a)
    try:
        x = torch.randint(0, 64, (2, 16))
        lm_loss(model, x[:, :-1], x[:, 1:]).backward()
    finally:
        lora_product.LoRAProduct.apply = real
    assert len(applied) == 2 * 6  # q, k, v, o, fc1, fc2 of each block

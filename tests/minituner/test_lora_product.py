"""minituner.lora_product: one adapter on a frozen base as one Function under bf16 compute (and fp32 where the fp32 C
kernels run: tests/minituner/test_native_lora_fp32.py), the same numbers as the two pieces it replaces (LoRAUpdate
after the base), and where it is not taken."""
import copy

import pytest
import torch
import torch.nn as nn

from miniquant import QuantizedLinear, nf4_matmul
from minituner import lora_product, native_lora, native_lora_fp32
from minituner.lora import LoRALinear
from minituner.precision import use_bf16_compute

BF16 = torch.bfloat16


def layer_in_bf16(base_kind: str, bias: bool = True, n_out: int = 48) -> nn.Module:
    """A LoRALinear (r 4) over an nn.Linear or NF4 base, B nonzero, in bf16 compute, wrapped so it can be swapped."""
    torch.manual_seed(0)
    linear = nn.Linear(64, n_out, bias=bias)
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


@pytest.fixture
def torch_products(monkeypatch):
    """LoRAProduct with the adapter's thin products as PyTorch ops (minituner.native_lora off)."""
    monkeypatch.setattr(native_lora, "fits", lambda *a: False)


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
def test_the_same_numbers_as_the_two_pieces(base_kind, bias, monkeypatch, torch_products):
    """With PyTorch's products: output and the masters' gradients bit for bit; x's gradient rounds the adapter's share once instead of
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


def test_not_taken_in_fp32_without_the_fp32_kernels_with_two_adapters_dropout_or_a_hooked_base(monkeypatch):
    torch.manual_seed(0)
    fp32 = nn.Sequential(LoRALinear(nn.Linear(64, 48), r=4))
    fp32[0].base_layer.requires_grad_(False)
    assert _not_fused(fp32, torch.randn(3, 64)) == (native_lora_fp32.kernels() is None)
    with monkeypatch.context() as m:
        m.setattr(native_lora_fp32, "kernels", lambda: None)  # a CPU without AVX2 and FMA: LoRAUpdate after the base
        assert _not_fused(fp32, torch.randn(3, 64))
    fp32[0].base_layer.bias.requires_grad_(True)  # a trained bias: not a frozen base
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


def reference(model: nn.Module, x: torch.Tensor, base_kind: str) -> tuple:
    """fp32 references of (output, grad of x, grad of A, grad of B) from the bf16 operands, g as run() draws it."""
    layer = model[0]
    w = (layer.base_layer.weight if base_kind == "linear" else layer.base_layer.dequantize(BF16)).float()
    bias = layer.base_layer.bias
    A, B = (layer.lora_A["default"].weight.to(BF16).float(), layer.lora_B["default"].weight.to(BF16).float())
    xf = x.float().reshape(-1, x.shape[-1])
    a = (xf @ A.t()).to(BF16).float()  # the kernel hands a over rounded, as the PyTorch path does
    y = xf @ w.t() + 2.0 * a @ B.t() + (0 if bias is None else bias.to(BF16).float())
    g = torch.randn(*x.shape[:-1], w.shape[0], generator=torch.Generator().manual_seed(3)).to(BF16).float()
    g = g.reshape(-1, w.shape[0])
    grad_a = (2.0 * g @ B).to(BF16).float()
    return y, g @ w + grad_a @ A, grad_a.t() @ xf, 2.0 * g.t() @ a


@pytest.mark.parametrize("base_kind", ["linear", "nf4"])
def test_the_c_thin_products_match_fp32_and_beat_pytorchs_rounding_of_the_masters_gradients(base_kind,
                                                                                              monkeypatch):
    """With minituner.native_lora (where this CPU has AVX512-BF16): output and x's gradient within a bf16 unit of the
    fp32 reference; the masters' gradients summed in fp32 and never rounded to bf16, so closer to it than the
    PyTorch path's."""
    if native_lora.kernels() is None:
        pytest.skip("no AVX512-BF16 here: minituner.native_lora is not built")
    model = layer_in_bf16(base_kind)
    x = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    y, gx, gA, gB, name = run(model, x, True, monkeypatch)
    assert name
    monkeypatch.setattr(native_lora, "fits", lambda *a: False)
    _, _, gA0, gB0, _ = run(model, x, True, monkeypatch)
    ry, rgx, rgA, rgB = reference(model, x, base_kind)
    for got, ref in ((y.reshape(ry.shape), ry), (gx.reshape(rgx.shape), rgx)):
        assert torch.allclose(got.float(), ref, rtol=2**-7, atol=2**-8 * ref.abs().max().item())
    for got, torch_path, ref in ((gA, gA0, rgA), (gB, gB0, rgB)):
        assert got.dtype == torch.float32
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
        assert (got - ref).abs().max() < (torch_path - ref).abs().max()  # bf16 rounding left the PyTorch path's


def test_native_lora_is_used_only_where_it_fits():
    A, B = torch.randn(4, 64), torch.randn(48, 4)
    x = torch.randn(3, 64).to(BF16)
    if native_lora.kernels() is None:
        assert not native_lora.fits(x, A, B)
        return
    assert native_lora.fits(x, A, B)
    assert not native_lora.fits(x.float(), A, B)  # fp32 compute
    assert not native_lora.fits(x, A[:3], B[:, :3])  # an odd rank: the kernels pair r
    assert not native_lora.fits(x, A.to(BF16), B.to(BF16))  # bf16 masters
    assert not native_lora.fits(x.t().contiguous().t(), A, B)  # rows not contiguous


def test_backward_uses_the_kernels_forward_took(monkeypatch):
    """The kernels are looked up once, in forward: turned off before backward (MINIQUANT_NATIVE=0), the step still
    finishes on the path its forward took."""
    if native_lora.kernels() is None:
        pytest.skip("no AVX512-BF16 here: minituner.native_lora is not built")
    model = layer_in_bf16("nf4")
    x = torch.randn(5, 64).to(BF16).requires_grad_()
    y = model(x)
    monkeypatch.setenv("MINIQUANT_NATIVE", "0")
    assert native_lora.kernels() is None
    y.float().sum().backward()
    assert x.grad is not None and model[0].lora_A["default"].weight.grad is not None


def test_an_output_the_kernels_saw_finite_is_not_read_again_by_the_guard(monkeypatch):
    """The C forward looks at every value it writes: the finite-output guard (minituner.qlora) skips its pass over
    that output, and still stops a non-finite one, naming the path; the answer holds for that tensor only, unchanged,
    once."""
    if native_lora.kernels() is None:
        pytest.skip("no AVX512-BF16 here: minituner.native_lora is not built")
    from minituner.qlora import add_finite_guards

    model = layer_in_bf16("nf4")
    layer = model[0]
    x = torch.randn(5, 64).to(BF16)
    y = layer(x)
    assert layer.output_seen_finite(y) and not layer.output_seen_finite(y)  # asked once
    y = layer(x)
    assert not layer.output_seen_finite(y.clone())  # another tensor
    y = layer(x)
    y.add_(1)
    assert not layer.output_seen_finite(y)  # changed since
    with monkeypatch.context() as m:  # PyTorch's products: nothing seen
        m.setattr(native_lora, "fits", lambda *a: False)
        y = layer(x)
        assert not layer.output_seen_finite(y)

    add_finite_guards(model)
    sums = []
    real_sum = torch.sum
    monkeypatch.setattr(torch, "sum", lambda *a, **k: sums.append(1) or real_sum(*a, **k))
    model(x)
    assert sums == []  # the guard took the kernels' word
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match=r"0: non-finite output .*the LoRA path"):
        model(x)
    monkeypatch.setattr(native_lora, "fits", lambda *a: False)
    with pytest.raises(FloatingPointError, match=r"0: non-finite output .*the LoRA path"):
        model(x)  # PyTorch's products: the guard's own pass finds it
    assert sums


def test_the_guard_still_reads_an_output_cast_to_fp16_or_made_in_inference_mode():
    """bf16 compute, fp16 in and out: a finite bf16 value above 65,504 is inf once cast, so the kernels' word does
    not carry over; under inference_mode (tensors without a version counter) the layer runs and the guard reads."""
    if native_lora.kernels() is None:
        pytest.skip("no AVX512-BF16 here: minituner.native_lora is not built")
    from minituner.qlora import add_finite_guards

    model = layer_in_bf16("nf4")
    add_finite_guards(model)
    x = torch.randn(5, 64)
    with torch.no_grad():
        model[0].lora_B["default"].weight.fill_(1e5)
    assert torch.isfinite(model(x.to(BF16))).all()  # finite in bf16
    with pytest.raises(FloatingPointError, match="non-finite output"):
        model(x.half())
    with torch.inference_mode():
        assert torch.isfinite(model(x.to(BF16))).all()
        with torch.no_grad():
            model[0].lora_B["default"].weight.fill_(float("inf"))
        with pytest.raises(FloatingPointError, match="non-finite output"):
            model(x.to(BF16))


def test_a_model_that_ran_the_kernels_still_pickles():
    model = layer_in_bf16("nf4")
    model(torch.randn(5, 64).to(BF16))
    import io
    torch.save(model, io.BytesIO())


def test_a_bf16_base_product_with_a_bias_runs_where_onednn_has_no_bf16(monkeypatch):
    """On a CPU whose oneDNN takes no bf16 (AVX2 only) the base product with a bias is F.linear's, the same bits."""
    from minikernels import fp32_gemm

    x, w, b = (torch.randn(*s).to(BF16) for s in ((7, 64), (48, 64), (48,)))
    monkeypatch.setattr(fp32_gemm, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr(fp32_gemm, "onednn_linear", lambda *a: pytest.fail("oneDNN called for bf16"))
    assert torch.equal(lora_product.base_product(x, w, b), torch.nn.functional.linear(x, w, b))


def _gelu_handed_over(model: nn.Module, h: torch.Tensor, approximate: str, hand_over: bool) -> tuple:
    """(output, grad of h, grads of A and B, autograd node names): the layer on GELU's output of h, computed as
    model[0](h, gelu=approximate) or as model[0](gelu(h))."""
    from minigpt import native_gelu

    model = copy.deepcopy(model)
    h = h.detach().clone().requires_grad_()
    y = model[0](h, gelu=approximate) if hand_over else model[0](native_gelu.gelu(h, approximate))
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype))
    layer = model[0]
    grads = [h.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]
    return [y.detach(), *grads], graph_names(y)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("base_kind, dtype", [("nf4", BF16), ("linear", BF16), ("nf4", torch.float32)])
def test_gelus_input_handed_over_gives_the_bits_of_gelu_then_the_layer(base_kind, dtype, approximate, amx,
                                                                       monkeypatch):
    """layer(h, gelu=...) is layer(gelu(h)) to the bit, output and every gradient: GELU inside LoRAProduct, its
    gradient applied inside miniquant.nf4_matmul's product (NF4 base, bf16, a CPU without AMX: mocked both ways)
    or after the base's input gradient as minigpt.native_gelu's backward (C) or aten's gelu_backward computes it."""
    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: amx)
    model = layer_in_bf16(base_kind, n_out=64) if dtype == BF16 else _fp32_nf4_layer()  # (out: NF4 product's NR)
    h = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    got, names = _gelu_handed_over(model, h, approximate, True)
    want, _ = _gelu_handed_over(model, h, approximate, False)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    fuses = model[0]._fuses_gelu(h)
    assert fuses == (base_kind == "nf4" and dtype == BF16 and nf4_matmul.kernels() is not None and not amx
                     and native_lora.kernels() is not None)  # elsewhere GELU is applied apart
    if fuses:
        assert fused_names(names) and not any("Gelu" in n for n in names)  # one node: GELU runs inside it


def fused_names(names: set[str]) -> bool:
    return any("LoRAProduct" in n for n in names)


def _fp32_nf4_layer() -> nn.Module:
    torch.manual_seed(0)
    base = QuantizedLinear.from_linear(nn.Linear(64, 48), "nf4_per_group_64")
    model = nn.Sequential(LoRALinear(base, r=4, alpha=8.0))
    with torch.no_grad():
        model[0].lora_B["default"].weight.normal_(0, 0.1)
    return model


def test_gelus_input_handed_over_where_the_layer_is_not_fused_is_gelu_then_the_layer():
    """Two active adapters, a disabled layer, or an input in another dtype than the compute dtype: GELU is applied
    first, as the model would, and the layer runs as it would on its output."""
    model = layer_in_bf16("nf4", n_out=64)
    layer = model[0]
    h = torch.randn(7, 64).to(BF16)
    from minigpt import native_gelu

    layer.add_adapter("second", 2, 4.0)
    layer.active_adapters = {"default": 1.0, "second": 0.5}
    with torch.no_grad():
        assert torch.equal(layer(h, gelu="none"), layer(native_gelu.gelu(h)))
    layer.active_adapters = {"default": 1.0}
    layer.disabled = True
    with torch.no_grad():
        assert torch.equal(layer(h, gelu="tanh"), layer(native_gelu.gelu(h, "tanh")))
    layer.disabled = False
    h32 = torch.randn(7, 64)
    with torch.no_grad():  # fp32 in: GELU on the fp32 values, then the one cast to bf16
        assert torch.equal(layer(h32, gelu="none"), layer(native_gelu.gelu(h32)))


def test_minigpts_mlp_hands_gelus_input_to_a_lora_fc2_and_the_step_keeps_its_bits(monkeypatch):
    """In a bf16 QLoRA MiniGPT each block's fc2 takes GELU's input (no GELU node of its own in the graph) where the
    C kernels run (native_lora and nf4_matmul: AVX512-BF16), elsewhere GELU stays a node of its own; either way the
    loss and every gradient are those of GELU applied apart (LoRALinear.takes_gelu_input off)."""
    from minigpt.model import GPTConfig, MiniGPT
    from minigpt.train import lm_loss
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: False)  # where AMX is, oneDNN's GEMM is chosen instead

    def step(hand_over: bool):
        monkeypatch.setattr(LoRALinear, "takes_gelu_input", hand_over)
        torch.manual_seed(0)
        model = build_for_training(MiniGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                                     d_model=32)),
                                   "qlora", LoRAConfig(r=4, alpha=8.0), device="cpu", precision="bf16",
                                   allow_slow_bf16=True)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, 0, 0.05)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = lm_loss(model, x[:, :-1], x[:, 1:])
        names, seen, todo = set(), set(), [loss.grad_fn]  # every node (graph_names expands one of each kind)
        while todo:
            fn = todo.pop()
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                names.add(type(fn).__name__)
                todo += [f for f, _ in fn.next_functions]
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, names

    loss, grads, names = step(True)
    want_loss, want_grads, want_names = step(False)
    assert torch.equal(loss, want_loss) and grads.keys() == want_grads.keys()
    assert all(torch.equal(grads[n], want_grads[n]) for n in grads)
    fused = native_lora.kernels() is not None and nf4_matmul.chosen()
    assert any("Gelu" in n for n in names) is not fused and any("Gelu" in n for n in want_names)


def test_the_guard_of_a_layer_handed_gelus_input_judges_gelus_output():
    """The finite-output guard sees the layer's kwargs: with gelu given, the layer's input is GELU's output of
    args[0], and a non-finite output is traced to that input or to the path that made it."""
    from minituner.qlora import add_finite_guards

    model = layer_in_bf16("nf4", n_out=64)
    add_finite_guards(model)
    layer = model[0]
    h = torch.randn(5, 64).to(BF16)
    layer(h, gelu="none")  # finite: no error
    bad = h.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"0: non-finite output .*its input"):
        layer(bad, gelu="none")
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match=r"0: non-finite output .*the LoRA path"):
        layer(h, gelu="tanh")



def test_with_grad_off_a_base_that_would_train_takes_it_and_gives_the_same_numbers(monkeypatch):
    """A LoRALinear made by hand (its base's weight still requires grad) under no_grad: nothing trains, so the
    fused Function runs, with the two pieces' numbers; with grad on the same layer keeps the two pieces."""
    import minituner.lora as lora

    torch.manual_seed(0)
    bf16 = layer_in_bf16("linear")
    bf16[0].base_layer.requires_grad_(True)
    fp32 = nn.Sequential(LoRALinear(nn.Linear(64, 48), r=4))  # the base's weight requires grad, as nn.Linear makes it
    with torch.no_grad():
        fp32[0].lora_B["default"].weight.normal_(0, 0.1)
    calls = []
    monkeypatch.setattr(lora, "lora_product", lambda *a, **k: calls.append(1) or lora_product.lora_product(*a, **k))
    cases = [(bf16, torch.randn(5, 64).to(BF16), 2e-2)]
    if native_lora_fp32.kernels() is not None:  # fp32 takes the Function only where its C kernels run
        cases.append((fp32, torch.randn(5, 64), 1e-5))
    for model, x, tol in cases:
        y = model(x)
        assert not calls and y.requires_grad  # grad on: the base gets a gradient, so the two pieces
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                fused_y = model(x)
                assert len(calls) == 1
                calls.clear()
                with monkeypatch.context() as m:
                    m.setattr(lora, "fused_fits", lambda *a: False)
                    torch.testing.assert_close(fused_y, model(x), atol=tol, rtol=tol)
        torch.testing.assert_close(fused_y, y.detach(), atol=tol, rtol=tol)

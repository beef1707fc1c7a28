"""minigpt.native_gelu: GPT-2's tanh GELU in C against PyTorch's bf16 F.gelu(approximate="tanh"), and the exact GELU's
gradient in C against PyTorch's gelu_backward and against the exact value, on the same values."""

import pytest
import torch
import torch.nn.functional as F

from minigpt import native_gelu

kernels = native_gelu.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler or no AVX-512: the kernels are not used")


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 2.0).to(torch.bfloat16), torch.randn(n, generator=g).to(torch.bfloat16)


def _ulps(a, b):
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _both(x, dy):
    """(ours, PyTorch's): the values and the gradients for x."""
    out = []
    for fn in (native_gelu.tanh_gelu, lambda t: F.gelu(t, approximate="tanh")):
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(dy)
        out.append((y.detach(), xr.grad))
    return out


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 300_001])  # every 16-lane tail, and a call split on threads
def test_values_and_gradients_match_pytorch(n):
    x, dy = _inputs(n, seed=n)
    (y, gx), (y_ref, gx_ref) = _both(x, dy)
    assert y.dtype == gx.dtype == torch.bfloat16 and y.shape == gx.shape == x.shape
    usual = x.float() >= -3.0  # below, PyTorch's 1 + tanh(u) cancels: values under 0.004 that differ more often
    for ours, theirs in ((y, y_ref), (gx, gx_ref)):
        assert _ulps(ours, theirs)[usual].max() <= 1
        assert (_ulps(ours, theirs)[usual] == 0).float().mean() >= (0.99 if n >= 1000 else 0.9)
        assert (ours.float() - theirs.float()).abs().max() <= 1e-4 + 2**-7 * theirs.float().abs().max()


@needs_kernels
def test_nan_and_inf_as_pytorch():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, -10.0, 3.0] * 2,
                     dtype=torch.bfloat16)
    dy = torch.ones_like(x)
    (y, gx), (y_ref, gx_ref) = _both(x, dy)  # 18 values: 16 lanes and a tail of 2 (through the same lanes)
    assert torch.equal(y.isnan(), y_ref.isnan())
    # the same bits, -0 at x = -10 too (σ(2u) = e^-87.3 underflows to 0 in both)
    assert torch.equal(y[~y.isnan()].view(torch.int16), y_ref[~y_ref.isnan()].view(torch.int16))
    assert torch.equal(gx.isnan(), gx_ref.isnan())


@needs_kernels
@pytest.mark.parametrize("gelu", [native_gelu.tanh_gelu, native_gelu.exact_gelu])
def test_it_keeps_its_input_only_when_a_gradient_is_wanted(gelu):
    x, _ = _inputs(64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gelu(x.clone().requires_grad_())
        assert len(saved) == 1 and saved[0].dtype == torch.bfloat16 and saved[0].numel() == 64
        gelu(x)
    assert len(saved) == 1


def test_what_it_does_not_take():
    x, _ = _inputs(32)
    assert not native_gelu.fits(x.float())  # fp32: PyTorch's
    assert not native_gelu.fits(x.view(4, 8).t())  # not contiguous
    y = native_gelu.tanh_gelu(x.float())  # PyTorch's, the same call
    assert y.dtype == torch.float32 and torch.equal(y, F.gelu(x.float(), approximate="tanh"))


@needs_kernels
@pytest.mark.parametrize("activation, function, other, decoder_names", [
    ("gelu_tanh", "_GeluTanh", "gelu", ["gelu_new", "gelu_pytorch_tanh"]),
    ("gelu", "_GeluExact", "gelu_tanh", ["gelu"]),
])
def test_minigpts_mlp_and_the_decoders_activations_take_their_kernels_in_bf16(monkeypatch, activation, function,
                                                                              other, decoder_names):
    from minigpt.decoder import ACTIVATIONS
    from minigpt.model import MLP, GPTConfig

    calls = []
    kernel = getattr(native_gelu, function)
    real = kernel.apply
    monkeypatch.setattr(kernel, "apply", lambda t: calls.append(t.shape) or real(t))
    mlp = lambda act: MLP(GPTConfig(vocab_size=8, d_model=16, n_head=2, activation=act))  # noqa: E731
    mlp(activation).to(torch.bfloat16)(torch.randn(2, 3, 16).to(torch.bfloat16))
    assert calls == [torch.Size([2, 3, 64])]
    for name in decoder_names:
        ACTIVATIONS[name](torch.randn(5).to(torch.bfloat16).requires_grad_())
    assert len(calls) == 1 + len(decoder_names)
    mlp(other).to(torch.bfloat16)(torch.randn(2, 3, 16).to(torch.bfloat16))  # the other form: not these kernels
    mlp(activation)(torch.randn(2, 3, 16))  # fp32: F.gelu
    assert len(calls) == 1 + len(decoder_names)


@needs_kernels
def test_the_exact_gelu_without_a_gradient_wanted_is_f_gelu_alone(monkeypatch):
    from minigpt.model import MLP, GPTConfig

    calls = []
    monkeypatch.setattr(native_gelu._GeluExact, "apply", lambda t: calls.append(t) or None)
    mlp = MLP(GPTConfig(vocab_size=8, d_model=16, n_head=2, activation="gelu")).to(torch.bfloat16)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    with torch.no_grad():
        y = mlp(x)
    assert calls == [] and torch.equal(y, mlp.fc2(F.gelu(mlp.fc1(x))).detach())


def test_a_build_without_avx512_is_not_used(plain_build):
    lib = plain_build("bf16_gelu_plain", native_gelu)
    assert lib.gelu_vectorized() == 0 and native_gelu._usable(lib) is None


def _exact_both(x, dy):
    """(ours, PyTorch's) for the exact GELU: the values and the gradients for x."""
    out = []
    for fn in (native_gelu.exact_gelu, F.gelu):
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(dy)
        out.append((y.detach(), xr.grad))
    return out


def _exact_gradient(x, dy):
    """dy·(Φ(x) + x·φ(x)) in fp64."""
    xd = x.double()
    return dy.double() * (0.5 * torch.erfc(-xd / 2**0.5) + xd * torch.exp(-xd * xd / 2) / (2 * torch.pi) ** 0.5)


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 300_001])  # every 16-lane tail, and a call split on threads
def test_exact_gelus_gradient_matches_pytorch_and_is_closer_to_the_exact_value(n):
    x, dy = _inputs(n, seed=n)
    (y, gx), (y_ref, gx_ref) = _exact_both(x, dy)
    assert torch.equal(y.view(torch.int16), y_ref.view(torch.int16))  # the forward is PyTorch's own
    assert gx.dtype == torch.bfloat16 and gx.shape == x.shape
    usual = x.float() >= -3.0  # below, PyTorch's 1 + erf(x/√2) cancels (Φ under 0.0014)
    assert _ulps(gx, gx_ref)[usual].max() <= 1
    assert (_ulps(gx, gx_ref)[usual] == 0).float().mean() >= (0.99 if n >= 1000 else 0.9)
    exact = _exact_gradient(x, dy)
    rounded = (gx == exact.to(torch.bfloat16)).float().mean()  # the share of values exactly rounded
    assert rounded >= (gx_ref == exact.to(torch.bfloat16)).float().mean() and rounded >= (0.995 if n >= 1000 else 0.9)
    # within a bf16 unit of the exact value (2^-8 relative), the tail too, but for fp32's own error near the
    # gradient's zero (x = -0.75, where Φ + x·φ cancels)
    assert ((gx.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6 * dy.double().abs()).all()


@needs_kernels
def test_exact_gelus_gradient_in_the_tail():
    """Where Φ(x) is small PyTorch's 1 + erf(x/√2) keeps few correct bits (zero from x = -5.4 on: the fp32 erf
    is -1); ours keeps erfc's own form."""
    x = torch.linspace(-9.0, -3.0, 600).to(torch.bfloat16)
    dy = torch.ones_like(x)
    (_, gx), (_, gx_ref) = _exact_both(x, dy)
    exact = _exact_gradient(x, dy)
    ours, theirs = ((g.double() - exact).abs() / exact.abs() for g in (gx, gx_ref))
    assert ours.max() <= 2**-8 and theirs.max() > 0.5


@needs_kernels
def test_exact_gelus_nan_and_inf_as_pytorch():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, -10.0, 3.0] * 2,
                     dtype=torch.bfloat16)
    (_, gx), (_, gx_ref) = _exact_both(x, torch.ones_like(x))  # 16 lanes and a tail of 2
    assert torch.equal(gx.isnan(), gx_ref.isnan())  # NaN at ±inf too (x·φ(x) = inf·0)
    same = ~gx.isnan() & (x != -10.0)
    assert torch.equal(gx[same].view(torch.int16), gx_ref[same].view(torch.int16))
    # at -10 PyTorch's is 0 (the tail above); ours the exact -7.6e-22
    exact = _exact_gradient(x, torch.ones_like(x))[x == -10.0]
    assert ((gx[x == -10.0].double() - exact).abs() <= 2**-8 * exact.abs()).all()


def test_the_exact_gelu_elsewhere_is_pytorchs():
    x, _ = _inputs(32)
    y = native_gelu.exact_gelu(x.float().requires_grad_())
    assert y.dtype == torch.float32 and torch.equal(y, F.gelu(x.float()))
    assert y.grad_fn.name() == "GeluBackward0"
    with pytest.raises(RuntimeError, match="approximate"):
        native_gelu.gelu(x, approximate="sigmoid")  # F.gelu's own error

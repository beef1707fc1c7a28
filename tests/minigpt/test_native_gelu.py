"""minigpt.native_gelu: GPT-2's tanh GELU in C against PyTorch's bf16 F.gelu(approximate="tanh") on the same values."""
import ctypes

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
def test_it_keeps_its_input_only_when_a_gradient_is_wanted():
    x, _ = _inputs(64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        native_gelu.tanh_gelu(x.clone().requires_grad_())
        assert len(saved) == 1 and saved[0].dtype == torch.bfloat16 and saved[0].numel() == 64
        native_gelu.tanh_gelu(x)
    assert len(saved) == 1


def test_what_it_does_not_take():
    x, _ = _inputs(32)
    assert not native_gelu.fits(x.float())  # fp32: PyTorch's
    assert not native_gelu.fits(x.view(4, 8).t())  # not contiguous
    y = native_gelu.tanh_gelu(x.float())  # PyTorch's, the same call
    assert y.dtype == torch.float32 and torch.equal(y, F.gelu(x.float(), approximate="tanh"))


@needs_kernels
def test_gpt2s_mlp_and_the_decoders_gelu_new_take_it_in_bf16(monkeypatch):
    from minigpt.decoder import ACTIVATIONS
    from minigpt.model import MLP, GPTConfig

    calls = []
    real = native_gelu._GeluTanh.apply
    monkeypatch.setattr(native_gelu._GeluTanh, "apply", lambda t: calls.append(t.shape) or real(t))
    mlp = MLP(GPTConfig(vocab_size=8, d_model=16, n_head=2, activation="gelu_tanh")).to(torch.bfloat16)
    mlp(torch.randn(2, 3, 16).to(torch.bfloat16))
    assert calls == [torch.Size([2, 3, 64])]
    ACTIVATIONS["gelu_new"](torch.randn(5).to(torch.bfloat16))
    ACTIVATIONS["gelu_pytorch_tanh"](torch.randn(5).to(torch.bfloat16))
    assert len(calls) == 3
    MLP(GPTConfig(vocab_size=8, d_model=16, n_head=2, activation="gelu")).to(torch.bfloat16)(
        torch.randn(2, 3, 16).to(torch.bfloat16))  # the exact GELU stays PyTorch's
    assert len(calls) == 3


def test_a_build_without_avx512_is_not_used(tmp_path, monkeypatch):
    from minikernels.build import build_library, find_compiler

    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    try:
        path = build_library("bf16_gelu_plain", native_gelu._SOURCE, native_gelu.CFLAGS + ["-mno-avx512f"],
                             compiler, native_gelu.LIBS)
    except RuntimeError as e:  # a compiler that does not know the flag (not x86)
        pytest.skip(f"cannot build without AVX-512 here: {e}")
    lib = ctypes.CDLL(str(path))
    assert lib.gelu_vectorized() == 0 and native_gelu._usable(lib) is None

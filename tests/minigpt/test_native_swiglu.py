"""minigpt.native_swiglu: SwiGLU's gate in C against PyTorch's bf16 ops (F.silu(gate) * up) on the same values."""

import pytest
import torch
import torch.nn.functional as F

from minigpt import native_swiglu

kernels = native_swiglu.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler or no AVX-512: the kernels are not used")


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up, dh = ((torch.randn(n, generator=g) * s).to(torch.bfloat16) for s in (4.0, 2.0, 1.0))
    return gate, up, dh


def _ulps(a, b):
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _reference(gate, up, dh, act=F.silu):
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = act(g) * u
    h.backward(dh)
    return h, g.grad, u.grad


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 70_001])  # every 16-lane tail, and a call split on threads
def test_values_and_gradients_match_pytorch_bf16_ops(n):
    gate, up, dh = _inputs(n, seed=n)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = native_swiglu.swiglu(g, u)
    h.backward(dh)
    ref = _reference(gate, up, dh)
    for ours, theirs in zip((h, g.grad, u.grad), ref):
        assert ours.dtype == torch.bfloat16 and ours.shape == theirs.shape
        # the same roundings of values within ~2e-6 of PyTorch's: act(gate) rounds to the neighbouring bf16 now and
        # then, and the product after it moves by a unit or two
        ulps = _ulps(ours, theirs)
        assert ulps.max() <= 2 and int((ulps != 0).sum()) <= max(1, n // 100)


@needs_kernels
def test_nan_and_inf_as_pytorch():
    gate = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 100.0, -100.0] * 3, dtype=torch.bfloat16)
    up = torch.ones_like(gate)
    dh = torch.ones_like(gate)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = native_swiglu.swiglu(g, u)
    h.backward(dh)
    for ours, theirs in zip((h, g.grad, u.grad), _reference(gate, up, dh)):
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


@needs_kernels
def test_denormal_results_keep_pytorchs_bits():
    """bf16 denormals are rounded as PyTorch rounds them, not flushed to zero (vcvtneps2bf16 would flush them)."""
    gate = torch.full((64,), 2.0, dtype=torch.bfloat16)
    up = (torch.rand(64, generator=torch.Generator().manual_seed(0)) * 5e-39).to(torch.bfloat16)
    ours, theirs = native_swiglu.swiglu(gate, up), F.silu(gate) * up
    assert (theirs != 0).all() and theirs.abs().max() < torch.finfo(torch.bfloat16).tiny
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@needs_kernels
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_it_keeps_gate_and_up_only_as_needed(needs):
    """gate when either input needs a gradient, up when gate does; never act(gate) (minituner.planner)."""
    gate, up, dh = _inputs(64)
    g, u = gate.clone().requires_grad_(needs[0]), up.clone().requires_grad_(needs[1])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = native_swiglu.swiglu(g, u)
    kept = sorted(t.data_ptr() for t in saved if t is not None)
    assert kept == sorted([g.data_ptr(), u.data_ptr()] if needs[0] else [g.data_ptr()])
    h.backward(dh)
    assert (g.grad is None) != needs[0] and (u.grad is None) != needs[1]


@needs_kernels
def test_another_activation_runs_as_pytorch_ops_keeping_the_same_tensors():
    gate, up, dh = _inputs(100)
    act = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = native_swiglu.swiglu(g, u, act)
    h.backward(dh)
    for ours, theirs in zip((h, g.grad, u.grad), _reference(gate, up, dh, act)):
        assert torch.equal(ours, theirs)


def test_what_it_does_not_take():
    gate, up, _ = _inputs(32)
    assert not native_swiglu.fits(gate.float(), up.float())
    assert not native_swiglu.fits(gate, up[:16])
    assert not native_swiglu.fits(gate.view(4, 8).t(), up.view(4, 8).t())


def test_a_build_without_avx512_is_not_used(plain_build):
    lib = plain_build("bf16_swiglu_plain", native_swiglu)
    assert lib.swiglu_vectorized() == 0 and native_swiglu._usable(lib) is None
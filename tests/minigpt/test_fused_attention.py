"""minigpt.fused_attention: bf16 causal attention on AMX's tiles against fp32 arithmetic, SDPA and the GEMM path."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from minigpt import fused_attention, native_attention
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minikernels.build import build_library, find_compiler

needs_amx = pytest.mark.skipif(native_attention.kernels() is None or not fused_attention.usable(),
                               reason="no CPU with AMX (amx_bf16) or no compiler for it: the kernels are not used")


def _inputs(B, h, kv, T, d, seed=0):
    """q, k, v as the models hand them over (views of (B, T, heads, d)), and a gradient for the output."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randn(B, T, n, d, generator=g).bfloat16().transpose(1, 2) for n in (h, kv, kv)]
    return heads, torch.randn(B, h, T, d, generator=g).bfloat16()


def _run(attend, inputs, dy, window=None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = attend(*leaves, window)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


def _gemm_path(q, k, v, window):
    return native_attention._CausalAttention.apply(q, k, v, window or 0)


@needs_amx
@pytest.mark.parametrize("B,h,kv,T,d,window", [
    (2, 4, 4, 37, 32, None), (2, 4, 2, 40, 64, None), (1, 8, 1, 33, 64, 7), (3, 2, 2, 1, 32, None),
    (1, 32, 8, 128, 64, None), (1, 4, 2, 100, 128, 40), (1, 2, 1, 96, 256, 33), (2, 2, 2, 64, 32, 64)])
def test_attention_and_its_gradients_are_as_close_to_fp32_as_sdpa_in_bf16(B, h, kv, T, d, window,
                                                                          attention_checks):
    """Against fp32 attention of the same bf16 values, the output and the three gradients stay within twice the
    error of PyTorch's SDPA run on the same bf16 tensors, for ragged T (blocks of 32 queries and keys with tails),
    grouped K/V heads, windows and widths up to MAX_HEAD_DIM; and within a bf16 rounding of the GEMM path's."""
    inputs, dy = _inputs(B, h, kv, T, d, seed=T)
    assert native_attention.fits(*inputs) and fused_attention.fits(*inputs)
    ours = _run(native_attention.causal_attention, inputs, dy, window)
    ref = [t.float().requires_grad_() for t in inputs]
    want = attention_checks.reference(*ref, window)
    want.backward(dy.float())
    g, mask = h // kv, attention_checks.visible(T, window)
    sdpa = _run(lambda q, k, v, w: F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask), inputs, dy, window)
    gemm = _run(_gemm_path, inputs, dy, window)
    for a, b, c, r in zip(ours, sdpa, gemm, [want.detach(), *(t.grad for t in ref)]):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape and torch.isfinite(a).all()
        assert attention_checks.as_close_as_sdpa(a, b, r), (attention_checks.rel(a, r), attention_checks.rel(b, r))
        torch.testing.assert_close(a.float(), c.float(), rtol=2 ** -6, atol=2 ** -8)


@needs_amx
def test_layouts_and_threads_change_nothing():
    """Contiguous (B, h, T, d) inputs give the bits of the models' views of (B, T, h, d), one thread the bits of
    several (each output's sums run in one order whatever the split); the output and the gradients come back laid
    out (B, T, heads, d), as the projections around attention want them."""
    views, dy = _inputs(2, 4, 2, 70, 64, seed=5)
    contiguous = [t.contiguous() for t in views]
    whole = _run(fused_attention.causal_attention, views, dy)
    for a, b in zip(whole, _run(fused_attention.causal_attention, contiguous, dy.transpose(1, 2).contiguous()
                                .transpose(1, 2))):
        assert torch.equal(a, b)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _run(fused_attention.causal_attention, views, dy)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(whole, one):
        assert torch.equal(a, b)
    y, *grads = whole
    assert all(t.transpose(1, 2).is_contiguous() for t in (y, *grads))


@needs_amx
def test_the_products_alone_skip_the_softmax():
    """gemms_only (the bench's floor) runs the block's products on S itself: with 32 tokens (one block of queries
    and keys) y is bf16(S)·v, S = bf16(q·kᵀ) over every key, unmasked."""
    (q, k, v), _ = _inputs(1, 2, 2, 32, 32, seed=2)
    y, _ = fused_attention.kernels().forward(q, k, v, gemms_only=True)
    s = (q.float() @ k.float().transpose(-1, -2)).bfloat16()
    torch.testing.assert_close(y.float(), (s.float() @ v.float()).bfloat16().float(), rtol=2 ** -7, atol=2 ** -7)


@needs_amx
def test_a_nan_in_a_query_makes_its_rows_nan_and_no_other():
    """The NaN stays with its query's row: its output, its q gradient, and the v gradient of the keys it sees; the K/V
    heads it does not read stay finite."""
    (q, k, v), dy = _inputs(1, 2, 2, 20, 32)
    q = q.clone()
    q[0, 1, 7, 3] = float("nan")
    y, dq, dk, dv = _run(fused_attention.causal_attention, [q, k, v], dy)
    assert torch.isnan(y[0, 1, 7]).all() and not torch.isnan(y[0, 0]).any() and not torch.isnan(y[0, 1, 8:]).any()
    assert torch.isnan(dq[0, 1, 7]).all() and not torch.isnan(dq[0, 1, 8:]).any()
    assert not torch.isnan(dv[0, 1, 8:]).any() and not torch.isnan(dk[0, 0]).any()


@needs_amx
def test_the_backward_is_once_differentiable():
    (q, k, v), dy = _inputs(1, 2, 2, 8, 32)
    q = q.detach().requires_grad_()
    (g,) = torch.autograd.grad(fused_attention.causal_attention(q, k, v), q, dy.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


def test_fits_heads_of_a_width_its_tiles_take(monkeypatch):
    (q, k, v), _ = _inputs(1, 4, 2, 8, 64)
    assert fused_attention.fits(q, k, v) == fused_attention.usable()
    assert not fused_attention.fits(q[..., :48], k[..., :48], v[..., :48])  # not a multiple of 32
    wide = torch.zeros(1, 1, 8, fused_attention.MAX_HEAD_DIM + 32, dtype=torch.bfloat16)
    assert not fused_attention.fits(wide, wide, wide)
    strided = q[..., ::2]
    assert not fused_attention.fits(strided, k[..., ::2], v[..., ::2])  # d not of unit stride
    monkeypatch.setenv("MINIQUANT_NATIVE", "0")
    assert fused_attention.kernels() is None and not fused_attention.fits(q, k, v)


def test_a_cpu_without_amx_builds_nothing(monkeypatch):
    """usable() reads the CPU's flags first: without amx_bf16 it says no before building the library (the planner
    asks it on every CPU)."""
    monkeypatch.setattr(fused_attention, "cpu_flag_set", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(fused_attention, "kernels", lambda: pytest.fail("built on a CPU without AMX"))
    assert not fused_attention.usable() and not fused_attention.head_fits(64)


def test_p_is_never_kept_on_the_tiles(monkeypatch):
    """The planner asks native_attention.keeps_probabilities: never where these kernels take the heads."""
    monkeypatch.setattr(fused_attention, "usable", lambda: True)
    assert not native_attention.keeps_probabilities(8, 8, 128, 64)  # kept on the GEMM path
    assert native_attention.keeps_probabilities(8, 8, 128, 48) == (8 * 128 <= 24 * 48)  # not a width taken here


@needs_amx
def test_without_linux_s_permission_it_refuses_rather_than_crash(monkeypatch):
    """Without the tiles granted, the first AMX instruction would kill the process (SIGILL): the kernels refuse."""
    lib = fused_attention.FusedAttention.__new__(fused_attention.FusedAttention)
    lib.__dict__.update(fused_attention.kernels().__dict__, _permitted=False)
    (q, k, v), _ = _inputs(1, 2, 2, 8, 32)
    with pytest.raises(RuntimeError, match="did not grant"):
        lib.forward(q, k, v)


@needs_amx
def test_a_build_without_amx_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    path = build_library("fused_attention_plain", fused_attention._SOURCE,
                         fused_attention.CFLAGS + ["-mno-amx-tile", "-mno-amx-bf16"], find_compiler(), fused_attention.LIBS)
    lib = ctypes.CDLL(str(path))
    assert lib.fused_attn_built() == 0 and fused_attention._FAMILY.usable(lib) is None


@needs_amx
def test_the_models_attend_here_in_bf16(attention_checks):
    """Both models (MiniGPT, the llama-family Decoder with GQA and a window) take this path for bf16 heads of 32
    while training; gradient checkpointing recomputes it to the same bits."""
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))
    gpt = MiniGPT(GPTConfig(vocab_size=50, block_size=48, n_layer=1, n_head=2, d_model=64, dropout=0.0))
    llama = Decoder(DecoderConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=128, d_ff=96,
                                  block_size=48, sliding_window=20, sliding_layers=[1]))
    for model in (gpt, llama):
        model.to(torch.bfloat16).train()
        assert "_FusedCausalAttentionBackward" in attention_checks.grad_fn_names(model(idx))
        assert attention_checks.checkpointing_changes_nothing(model, idx)

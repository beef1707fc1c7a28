"""minigpt.fused_attention: bf16 causal attention in one C call each way (on AMX's tiles or as AVX512-BF16's
vdpbf16ps) against fp32 arithmetic, SDPA and the GEMM path."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from minigpt import fused_attention, native_attention
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minikernels.build import build_library, find_compiler

needs_units = pytest.mark.skipif(native_attention.kernels() is None or not fused_attention.usable(),
                                 reason="no CPU with bf16 units (avx512_bf16, amx_bf16) or no compiler for them: the "
                                        "kernels are not used")


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


@needs_units
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


@needs_units
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


@needs_units
def test_the_products_alone_skip_the_softmax():
    """gemms_only (the bench's floor) runs the block's products on S itself: with 32 tokens (one block of queries
    and keys) y is bf16(S)·v, S = bf16(q·kᵀ) over every key, unmasked."""
    (q, k, v), _ = _inputs(1, 2, 2, 32, 32, seed=2)
    y, _ = fused_attention.kernels().forward(q, k, v, gemms_only=True)
    s = (q.float() @ k.float().transpose(-1, -2)).bfloat16()
    torch.testing.assert_close(y.float(), (s.float() @ v.float()).bfloat16().float(), rtol=2 ** -7, atol=2 ** -7)


@needs_units
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


@needs_units
def test_the_backward_is_once_differentiable():
    (q, k, v), dy = _inputs(1, 2, 2, 8, 32)
    q = q.detach().requires_grad_()
    (g,) = torch.autograd.grad(fused_attention.causal_attention(q, k, v), q, dy.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


def test_fits_heads_of_a_width_its_products_take(monkeypatch):
    (q, k, v), _ = _inputs(1, 4, 2, 8, 64)
    assert fused_attention.fits(q, k, v) == fused_attention.usable()
    assert not fused_attention.fits(q[..., :48], k[..., :48], v[..., :48])  # not a multiple of 32
    wide = torch.zeros(1, 1, 8, fused_attention.MAX_HEAD_DIM + 32, dtype=torch.bfloat16)
    assert not fused_attention.fits(wide, wide, wide)
    strided = q[..., ::2]
    assert not fused_attention.fits(strided, k[..., ::2], v[..., ::2])  # d not of unit stride
    monkeypatch.setenv("MINIQUANT_NATIVE", "0")
    assert fused_attention.kernels() is None and not fused_attention.fits(q, k, v)


def test_a_cpu_without_bf16_units_builds_nothing(monkeypatch):
    """usable() reads the CPU's flags first: without avx512_bf16 or amx_bf16 it says no before building the library
    (the planner asks it on every CPU)."""
    monkeypatch.setattr(fused_attention, "cpu_flag_set", lambda: frozenset({"avx512f", "avx512bw", "avx512vl"}))
    monkeypatch.setattr(fused_attention, "kernels", lambda: pytest.fail("built on a CPU without bf16 units"))
    assert not fused_attention.usable() and not fused_attention.head_fits(64)


@pytest.mark.parametrize("flags", [{"avx512f", "avx512_bf16"}, {"avx512f", "avx512_bf16", "amx_bf16"}])
def test_either_kind_of_bf16_unit_is_enough(monkeypatch, flags):
    """AVX512-BF16 alone (an AMD EPYC of Zen 4 or 5) runs the products as vdpbf16ps; AMX's tiles where they are."""
    monkeypatch.setattr(fused_attention, "cpu_flag_set", lambda: frozenset(flags))
    monkeypatch.setattr(fused_attention, "kernels", lambda: type("Lib", (), {"permitted": lambda self: True})())
    assert fused_attention.usable() and fused_attention.head_fits(64)


def test_p_is_never_kept_on_the_fused_path(monkeypatch):
    """The planner asks native_attention.keeps_probabilities: never where these kernels take the heads."""
    monkeypatch.setattr(fused_attention, "usable", lambda: True)
    assert not native_attention.keeps_probabilities(8, 8, 128, 64)  # kept on the GEMM path
    assert native_attention.keeps_probabilities(8, 8, 128, 48) == (8 * 128 <= 24 * 48)  # not a width taken here


@needs_units
def test_without_linux_s_permission_it_refuses_rather_than_crash(monkeypatch):
    """Without the tiles granted, the first AMX instruction would kill the process (SIGILL): the kernels refuse."""
    lib = fused_attention.FusedAttention.__new__(fused_attention.FusedAttention)
    lib.__dict__.update(fused_attention.kernels().__dict__, _permitted=False)
    (q, k, v), _ = _inputs(1, 2, 2, 8, 32)
    with pytest.raises(RuntimeError, match="did not grant"):
        lib.forward(q, k, v)


def _build(tmp_path, monkeypatch, name, flags):
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    path = build_library(name, fused_attention._SOURCE, fused_attention.CFLAGS + flags, find_compiler(),
                         fused_attention.LIBS)
    return ctypes.CDLL(str(path))


@needs_units
def test_a_build_without_bf16_units_is_not_used(tmp_path, monkeypatch):
    lib = _build(tmp_path, monkeypatch, "fused_attention_plain", ["-mno-amx-tile", "-mno-amx-bf16", "-mno-avx512bf16"])
    assert lib.fused_attn_built() == 0 and fused_attention._FAMILY.usable(lib) is None


def test_the_tiles_build_compiles_on_any_cpu(tmp_path, monkeypatch):
    """Built for AMX's tiles (as -march=native builds it on a CPU with them) the library compiles and says it
    multiplies on the tiles; it runs only on such a CPU (the tests above, there), so a CPU without AMX checks that
    much of that path."""
    if find_compiler() is None:
        pytest.skip("no C compiler")
    try:
        lib = _build(tmp_path, monkeypatch, "fused_attention_tiles",
                     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"])
    except RuntimeError as e:  # a compiler (or an architecture) without these flags
        pytest.skip(f"the compiler does not build for AMX here: {e}")
    assert lib.fused_attn_built() == 1 and lib.fused_attn_tiles() == 1


@needs_units
def test_the_dot_product_build_agrees_with_the_one_in_use(tmp_path, monkeypatch):
    """Built without AMX's tiles (as on a CPU with AVX512-BF16 alone) the products run as vdpbf16ps, each pair of
    products added to the sum in one instruction: the output and gradients within a bf16 rounding of the library in
    use (the same bits where that is this build: a CPU without AMX)."""
    lib = fused_attention.FusedAttention(_build(tmp_path, monkeypatch, "fused_attention_dots",
                                                ["-mno-amx-tile", "-mno-amx-bf16"]))
    assert not lib.tiles and lib.permitted()
    (q, k, v), dy = _inputs(2, 4, 2, 70, 64, seed=3)
    ours, theirs = fused_attention.kernels(), lib
    y, lse = ours.forward(q, k, v, 9)
    y2, lse2 = theirs.forward(q, k, v, 9)
    got = [y2, lse2, *theirs.backward(q, k, v, dy, lse2, 9)]
    for a, b in zip([y, lse, *ours.backward(q, k, v, dy, lse, 9)], got):
        if ours.tiles:
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2 ** -8)
        else:
            assert torch.equal(a, b)


@needs_units
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

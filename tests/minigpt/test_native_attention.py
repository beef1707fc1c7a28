"""minigpt.native_attention: bf16 causal attention (bf16 GEMMs + C softmax) against fp32 arithmetic and SDPA. Every
test here runs the GEMM path, AMX's tiles set aside where the CPU has them (tests/minigpt/test_fused_attention.py
holds that path)."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from minigpt import native_attention
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minikernels.build import build_library, find_compiler

kernels = native_attention.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler or no AVX-512: the kernels are not built")


@pytest.fixture(autouse=True)
def gemm_path(monkeypatch):
    """The GEMM path, also on a CPU with AMX (minigpt.fused_attention takes no heads)."""
    monkeypatch.setattr(native_attention.fused_attention, "head_fits", lambda head_dim: False)
    monkeypatch.setattr(native_attention.fused_attention, "fits", lambda q, k, v: False)


def _inputs(B, h, kv, T, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=g).bfloat16() for n in (h, kv, kv)], \
        torch.randn(B, h, T, d, generator=g).bfloat16()


@needs_kernels
@pytest.mark.parametrize("T", [1, 15, 16, 17, 40, 130])  # every tail of the 16- and 32-wide loops
@pytest.mark.parametrize("window", [None, 5])
def test_softmax_kernel_matches_fp32_torch(T, window, attention_checks):
    """Each row: softmax of the visible scores · scale in fp32, 0 elsewhere, one bf16 rounding; the logsumexp
    within fp32 rounding of torch's; P recomputed from that logsumexp within one bf16 unit of the first."""
    g = torch.Generator().manual_seed(T)
    s = (torch.randn(2, 3 * T, T, generator=g) * 8).bfloat16()  # 2 groups, 3 query heads stacked
    scale = 0.125
    rows_t = torch.arange(3 * T) % T
    mask = attention_checks.visible(T, window)[rows_t]  # (3T, T)
    x = (s.float() * scale).masked_fill(~mask, float("-inf"))
    want_p, want_lse = torch.softmax(x, -1), torch.logsumexp(x, -1).flatten()
    p, lse = s.clone(), torch.empty(2 * 3 * T)
    kernels.softmax_(p, T, window or 0, scale, lse, have_lse=False)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p.float(), want_p, rtol=2 ** -7, atol=1e-7)
    assert torch.all(p.float()[:, ~mask] == 0)
    again = s.clone()
    kernels.softmax_(again, T, window or 0, scale, lse, have_lse=True)
    torch.testing.assert_close(again.float(), p.float(), rtol=2 ** -7, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("T", [1, 17, 64])
def test_softmax_gradient_kernel_matches_fp32_torch(T, attention_checks):
    g = torch.Generator().manual_seed(T)
    mask = attention_checks.visible(T)
    p = torch.softmax(torch.randn(2, T, T, generator=g).masked_fill(~mask, float("-inf")), -1).bfloat16()
    dp = torch.randn(2, T, T, generator=g).bfloat16()
    D = (p.float() * dp.float()).sum(-1, keepdim=True)  # rowsum(P ∘ dP) of the same bf16 values
    want = p.float() * (dp.float() - D) * 0.25
    kernels.softmax_grad_(p, dp, T, 0, 0.25)
    torch.testing.assert_close(dp.float(), want, rtol=2 ** -7, atol=1e-6)
    assert torch.all(dp.float()[:, ~mask] == 0)
    if T == 1:  # one visible key: softmax is constant, its gradient exactly 0
        assert torch.all(dp == 0)


@needs_kernels
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("B,h,kv,T,d,window", [(2, 4, 4, 37, 16, None), (2, 4, 2, 40, 32, None),
                                               (1, 8, 1, 33, 64, 7), (3, 2, 2, 1, 8, None), (1, 32, 8, 128, 64, None)])
def test_attention_and_its_gradients_are_as_close_to_fp32_as_sdpa_in_bf16(B, h, kv, T, d, window, keep,
                                                                          monkeypatch, attention_checks):
    """Against fp32 attention of the same bf16 values, ours (S rounded to bf16, as transformers' eager bf16
    attention) stays within twice the error of PyTorch's SDPA run on the same bf16 tensors (S kept in fp32),
    with P kept for backward and with P recomputed there."""
    monkeypatch.setattr(native_attention, "keeps_probabilities", lambda *shape: keep)
    (q, k, v), dy = _inputs(B, h, kv, T, d, seed=T)
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    attention_checks.reference(*ref, window).backward(dy.float())
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    y = native_attention.causal_attention(*ours, window)
    y.backward(dy)
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    g = h // kv
    y_sdpa = F.scaled_dot_product_attention(theirs[0], theirs[1].repeat_interleave(g, 1),
                                            theirs[2].repeat_interleave(g, 1),
                                            attn_mask=attention_checks.visible(T, window))
    y_sdpa.backward(dy)
    assert y.dtype == torch.bfloat16 and y.shape == (B, h, T, d)
    want = attention_checks.reference(q, k, v, window)
    for a, b, r in [(y, y_sdpa, want), *((o.grad, t.grad, x.grad) for o, t, x in zip(ours, theirs, ref))]:
        assert a.shape == r.shape and torch.isfinite(a).all()
        assert attention_checks.as_close_as_sdpa(a, b, r), (attention_checks.rel(a, r), attention_checks.rel(b, r))


@needs_kernels
@pytest.mark.parametrize("keep", [True, False])
def test_layouts_and_chunks_change_nothing(monkeypatch, keep):
    """q, k, v as the models hand them over (views of (B, T, h, d)) give the same bits as contiguous ones, and
    the scores made one K/V group at a time the same bits as all at once (P kept or recomputed). The output is
    laid out (B, T, h, d)."""
    monkeypatch.setattr(native_attention, "keeps_probabilities", lambda *shape: keep)
    (q, k, v), dy = _inputs(2, 4, 2, 24, 16)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]

    def run(inputs):
        inputs = [t.clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_() for t in inputs]
        y = native_attention.causal_attention(*inputs)
        y.backward(dy)
        return [y.detach(), *(t.grad for t in inputs)]

    whole = run([q, k, v])
    for a, b in zip(whole, run(views)):
        assert torch.equal(a, b)
    monkeypatch.setattr(native_attention, "CHUNK_BYTES", 1)  # one group per chunk
    for a, b in zip(whole, run([q, k, v])):
        assert torch.equal(a, b)
    y = native_attention.causal_attention(q, k, v)
    assert y.transpose(1, 2).is_contiguous()  # o_proj's input is a view of it, as of the fused kernel's output


def test_p_is_kept_where_it_is_no_larger_than_q_k_and_v():
    """h·T <= (h + 2·kv)·d: the bench's GPT shape (8 heads of 64, 128 tokens) keeps P, Llama-3.2-1B's at 512
    tokens (32 heads, 8 KV heads of 64) recomputes it; the boundary keeps."""
    assert native_attention.keeps_probabilities(8, 8, 128, 64)
    assert not native_attention.keeps_probabilities(32, 8, 512, 64)
    assert native_attention.keeps_probabilities(4, 2, 64, 32) and not native_attention.keeps_probabilities(4, 2, 65, 32)


@needs_kernels
def test_kept_p_gives_the_gradients_of_the_recomputed_one_within_a_bf16_rounding(monkeypatch):
    """The forward's P (e/Σ) and the recomputed one (exp(s - lse)) may differ in a last bf16 place: the
    gradients agree within that."""
    (q, k, v), dy = _inputs(2, 4, 2, 40, 32, seed=3)
    grads = {}
    for keep in (True, False):
        monkeypatch.setattr(native_attention, "keeps_probabilities", lambda *shape, keep=keep: keep)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        native_attention.causal_attention(*inputs).backward(dy)
        grads[keep] = [t.grad.float() for t in inputs]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=2 ** -6, atol=2 ** -10)


@needs_kernels
def test_a_nan_in_a_query_makes_its_rows_nan_and_no_other():
    """The NaN stays with its query's row: its output, its q gradient, and the v gradient of the keys it sees (the k
    gradient of every key meets the NaN query in dSᵀ·q's sum, where 0·NaN is NaN, as in any GEMM)."""
    (q, k, v), dy = _inputs(1, 2, 2, 20, 16)
    q[0, 1, 7, 3] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    y = native_attention.causal_attention(q, k, v)
    assert torch.isnan(y[0, 1, 7]).all() and not torch.isnan(y[0, 0]).any() and not torch.isnan(y[0, 1, 8:]).any()
    y.backward(dy)
    assert torch.isnan(q.grad[0, 1, 7]).all() and not torch.isnan(q.grad[0, 1, 8:]).any()
    assert not torch.isnan(v.grad[0, 1, 8:]).any() and not torch.isnan(k.grad[0, 0]).any()  # keys it cannot see


@needs_kernels
def test_the_backward_is_once_differentiable():
    (q, k, v), dy = _inputs(1, 2, 2, 8, 16)
    q.requires_grad_()
    (g,) = torch.autograd.grad(native_attention.causal_attention(q, k, v), q, dy.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


def test_fits_only_bf16_cpu_self_attention_within_its_length(monkeypatch):
    (q, k, v), _ = _inputs(1, 4, 2, 8, 16)
    if kernels is not None:
        assert native_attention.fits(q, k, v)
    assert not native_attention.fits(q.float(), k.float(), v.float())
    assert not native_attention.fits(q[:, :, :4], k, v)  # generation after its first call: more keys than queries
    assert not native_attention.fits(q[:, :3], k, v)  # 3 query heads over 2 K/V heads
    assert not native_attention.fits(q[..., :8], k, v)  # head widths that differ
    assert not native_attention.fits(q[:, :, :0], k[:, :, :0], v[:, :, :0])  # no tokens: SDPA's empty result
    long = torch.zeros(1, 1, native_attention.MAX_TOKENS + 1, 8, dtype=torch.bfloat16)
    assert not native_attention.fits(long, long, long)
    monkeypatch.setenv("MINIQUANT_NATIVE", "0")
    assert native_attention.kernels() is None and not native_attention.fits(q, k, v)


@needs_kernels
def test_a_build_without_avx512_is_not_used(tmp_path, monkeypatch):
    """The kernels' 16-lane loops need AVX-512; a plain-C build reports it and is refused."""
    compiler = find_compiler()
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    path = build_library("bf16_attention_plain", native_attention._SOURCE,
                         native_attention.CFLAGS + ["-mno-avx512f"], compiler, native_attention.LIBS)
    lib = ctypes.CDLL(str(path))
    assert lib.attn_vectorized() == 0 and native_attention._usable(lib) is None


@needs_kernels
def test_a_build_without_avx512_bw_gives_the_same_bits(tmp_path, monkeypatch):
    """A row's last n < 16 keys go through the 16-lane code either way: with AVX512-BW's masked loads and stores
    (this build, where the CPU has them) or through TAIL16's zero-padded block (a build without them): the same
    P, logsumexp and dS to the bit, for every tail length."""
    compiler = find_compiler()
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    path = build_library("bf16_attention_no_bw", native_attention._SOURCE,
                         native_attention.CFLAGS + ["-mno-avx512bw", "-mno-avx512vl"], compiler, native_attention.LIBS)
    other = native_attention._usable(ctypes.CDLL(str(path)))
    assert other is not None  # still AVX-512F: vectorized
    T = 37  # rows of 1 to 37 visible keys: every tail from 0 to 15
    g = torch.Generator().manual_seed(3)
    s = (torch.randn(2, 2 * T, T, generator=g) * 8).bfloat16()
    dp = torch.randn(2, 2 * T, T, generator=g).bfloat16()
    for window in (0, 5):
        results = []
        for lib in (kernels, other):
            p, lse, again, ds = s.clone(), torch.empty(4 * T), s.clone(), dp.clone()
            lib.softmax_(p, T, window, 0.125, lse, have_lse=False)
            lib.softmax_(again, T, window, 0.125, lse, have_lse=True)
            lib.softmax_grad_(p, ds, T, window, 0.125)
            results.append((p, lse, again, ds))
        for a, b in zip(*results):
            assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("dtype,native", [(torch.bfloat16, True), (torch.float32, False)])
def test_the_models_attend_here_in_bf16_and_through_sdpa_in_fp32(dtype, native, attention_checks):
    """Both models (MiniGPT, the llama-family Decoder with GQA and a window) take this path for bf16 on CPU while
    training and in a plain forward; fp32 keeps SDPA. Gradient checkpointing recomputes it to the same bits."""
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    gpt = MiniGPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, d_model=16, dropout=0.0))
    llama = Decoder(DecoderConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48,
                                  block_size=16, sliding_window=4, sliding_layers=[1]))
    for model in (gpt, llama):
        model.to(dtype).train()
        names = attention_checks.grad_fn_names(model(idx))
        assert ("_CausalAttentionBackward" in names) == native
        if native:
            assert attention_checks.checkpointing_changes_nothing(model, idx)

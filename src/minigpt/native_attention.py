"""Causal self-attention for bf16 on CPU: the products as batched GEMMs, the softmax and its gradient in C.

    if fits(q, k, v):                       # bf16 on CPU, T queries over the same T keys, kernels built
        y = causal_attention(q, k, v, window=None)   # (B, h, T, d); k, v may have fewer (kv) heads

What it computes is ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` (with a
sliding window: each query sees itself and the window - 1 keys before it), as transformers' "eager" attention
does it in bf16: S = q·kᵀ by ``torch.bmm`` (bf16 in, fp32 accumulation, S rounded to bf16), P = softmax(S·d^-½)
per row in fp32 (C: the row's maximum, Σ exp, then P written in bf16 over S), y = P·v by ``torch.bmm``.
PyTorch's fused CPU kernel (flash) keeps S in fp32 instead and skips the masked half, but on a 2-core
CPU its bf16 run is no faster than its fp32 one (oneDNN's bf16 GEMMs are several times faster): at
Llama-3.2-1B's shape (32 heads, 8 KV heads, 512 tokens) one layer's forward and backward take about 36 ms
through it and about 9.5 ms in bf16 GEMMs (benchmarks/RESULTS.md has the whole-step figures).

On a CPU with bf16 units (avx512_bf16 or amx_bf16) heads whose width is a multiple of 32 go to
``minigpt.fused_attention`` instead: the same roundings computed a block of queries at a time in one C call (on
AMX's tiles, or as AVX512-BF16's dot products), each block's scores kept in the thread's cache and only the keys
it sees multiplied; q, k, v read where they lie; P always recomputed in backward. What follows is the GEMM path,
taken elsewhere (other head widths; a CPU with AVX-512 but no bf16 units, where bf16 runs only when the user
insists).

Grouped-query attention without repeating K/V: the g = h / kv query heads that share a K/V head are stacked
as g·T rows of one GEMM against that head's T keys, so S is (B·kv, g·T, T) and row r is query t = r mod T.

Backward (FlashAttention-2's): P, then dV = Pᵀ·dy, dP = dy·vᵀ, then in C per row D = Σ_j P·dP (fp32, from
the same bf16 P and dP, so each row of dS sums to 0 as softmax's gradient must) and dS = P ∘ (dP - D)·d^-½
written over dP, and dq = dS·k, dk = dSᵀ·q (``bmm``). P is the forward's, kept, where it takes no more memory
than the q, k and v attention keeps anyway (``keeps_probabilities``: h·T <= (h + 2·kv)·d, short sequences);
elsewhere it is recomputed from the saved logsumexp (S again by ``bmm``, P = exp(S·d^-½ - lse) in C), as
FlashAttention-2 does. On the bench's GPT-shaped bf16 QLoRA step (8 layers, 8 heads of 64, 8 × 128 tokens:
2 MiB of P a layer; AMD EPYC with AVX512-BF16, 2 cores) keeping it took 4.1 ms off a 176 ms step (median of 20
paced turns, faster in 16, 2026-12-05), a GEMM and a pass of exp a layer, before that CPU's heads went to
``minigpt.fused_attention``. It saves q, k, v, as the grouped copies
its GEMMs read (so backward does not copy them again, and the tensors they were copied from, the projections' or
rotary embedding's outputs, are freed: the same bytes; where the grouping is a view nothing is copied), and P
(bf16, B·h·T²) where kept, else the logsumexp per query and head (fp32); not its output, which the fused kernel
also keeps (FlashAttention-2 takes D from it): the o_proj that follows keeps that only when it trains
(``minituner.planner`` counts each way). The output is laid out (B, T, h, d), as the fused kernel lays it
out, so o_proj's input is a view of it. The (g·T, T) scores are made a few K/V groups at a time (at most
``CHUNK_BYTES`` of S at once, never less than one group; into the kept P where it is kept), so the transient
memory stays small (and S stays in cache between the GEMM that writes it and the kernel that reads it);
sequences over ``MAX_TOKENS`` are left to the fused kernel, whose memory does not grow with T² and which skips
the masked half (there the two take the same time).

exp and the bf16 rounding are ``minikernels.bf16_exp``'s. A row whose visible scores hold a NaN or an inf gives
NaN (as softmax does for NaN; an inf score is NaN there too, inf - inf). Used only where the C was built with
AVX-512 (``attn_vectorized``); elsewhere, and for fp32, fp16, CUDA, dropout and generation's steps after the first
(more keys than queries; its first call, over an empty cache, attends here), the models call
``F.scaled_dot_product_attention``.
"""
from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, parallel_entry
from minikernels.softmax_rows import SOFTMAX_ROWS_C

from . import fused_attention

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]  # expf, logf
CHUNK_BYTES = 2 << 20  # the scores S of at most this many bytes exist at once (but always one K/V group)
# longer sequences go to the fused kernel: at 1,024 tokens (32 heads, 8 KV heads, 2 cores) the two took the same
# time for forward and backward (87 vs 90 ms), and S grows as T² while the fused kernel's memory does not
MAX_TOKENS = 1024
MIN_VALUES_PER_THREAD = 1 << 16  # fewer scores stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 16  # threads take rows in chunks of about this many scores

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + SOFTMAX_ROWS_C + r"""
int attn_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Rows [r0, r1) of s (bf16 scores, rows `ld` apart, T keys each; row r is query r mod T): each overwritten with
   P = softmax(s·scale) over its visible keys, 0 elsewhere (softmax_row), its logsumexp into lse[r] (have_lse = 0)
   or taken from there (1) */
void attn_softmax(uint16_t* s, int64_t ld, int64_t T, int64_t window, float scale, int64_t r0, int64_t r1,
                  float* lse, int have_lse) {
    for (int64_t r = r0, t = r0 % T; r < r1; r++, t = t + 1 == T ? 0 : t + 1)
        softmax_row(s + r * ld, NULL, 0, T, t, window, scale, lse + r, have_lse);
}

/* Rows [r0, r1): dp = dS = P ∘ (dP - D)·scale in place (softmax_grad_row) */
void attn_softmax_grad(const uint16_t* p, uint16_t* dp, int64_t ld, int64_t T, int64_t window, float scale,
                       int64_t r0, int64_t r1) {
    for (int64_t r = r0, t = r0 % T; r < r1; r++, t = t + 1 == T ? 0 : t + 1)
        softmax_grad_row(p + r * ld, dp + r * ld, NULL, 0, T, t, window, scale);
}

/* the two above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void attn_softmax_parallel(uint16_t* s, int64_t ld, int64_t T, int64_t window, float scale, int64_t b0, int64_t b1,
                           float* lse, int have_lse, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, attn_softmax(s, ld, T, window, scale, r0, r1, lse, have_lse));
}

void attn_softmax_grad_parallel(const uint16_t* p, uint16_t* dp, int64_t ld, int64_t T, int64_t window, float scale,
                                int64_t b0, int64_t b1, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, attn_softmax_grad(p, dp, ld, T, window, scale, r0, r1));
}
"""


class AttentionKernels:
    """The compiled softmax kernels, rows split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._softmax = lib.attn_softmax
        self._softmax.argtypes = [ptr, i64, i64, i64, f32, i64, i64, ptr, ctypes.c_int]
        self._softmax.restype = None
        self._softmax_parallel = parallel_entry(lib, self._softmax)  # over OpenMP's threads
        self._grad = lib.attn_softmax_grad
        self._grad.argtypes = [ptr, ptr, i64, i64, i64, f32, i64, i64]
        self._grad.restype = None
        self._grad_parallel = parallel_entry(lib, self._grad)  # over OpenMP's threads
        self._threads = ThreadSplit("minigpt-attention", openmp=bool(lib.mk_openmp()))

    def softmax_(self, s: Tensor, T: int, window: int, scale: float, lse: Tensor, have_lse: bool) -> None:
        """s (G, R, T) bf16 contiguous, rows r = query r mod T: overwritten with P; lse (G·R,) fp32 read or written."""
        rows = s.numel() // T
        args = (s.data_ptr(), T, T, window, scale)
        tail = (lse.data_ptr(), int(have_lse))
        self._threads.run(rows, T, lambda r0, r1: self._softmax(*args, r0, r1, *tail), MIN_VALUES_PER_THREAD,
                          CHUNK_VALUES, lambda r0, r1, n, t: self._softmax_parallel(*args, r0, r1, *tail, n, t))

    def softmax_grad_(self, p: Tensor, dp: Tensor, T: int, window: int, scale: float) -> None:
        """dp (G, R, T) bf16 contiguous overwritten with P ∘ (dP - D)·scale, D = rowsum(P ∘ dP) in fp32."""
        rows = dp.numel() // T
        args = (p.data_ptr(), dp.data_ptr(), T, T, window, scale)
        self._threads.run(rows, T, lambda r0, r1: self._grad(*args, r0, r1), MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda r0, r1, n, t: self._grad_parallel(*args, r0, r1, n, t))


_FAMILY = KernelFamily("bf16_attention", _SOURCE, CFLAGS, "minigpt's native attention kernels", AttentionKernels,
                       LIBS, vectorized="attn_vectorized", parallel=True)
_usable = _FAMILY.usable  # None for a library built without AVX-512


def kernels() -> AttentionKernels | None:
    """The native attention kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()


def fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether causal_attention takes these: bf16 on CPU, (B, h, T, d) queries over (B, kv, T, d) keys and values
    (kv dividing h), 1 <= T <= MAX_TOKENS, and the kernels built."""
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and q.dim() == 4):
        return False
    B, h, T, d = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[2] != T or k.shape[3] != d or h % k.shape[1]:
        return False
    return T >= 1 and takes_bf16_run(T)  # the planner asks the same question


def takes_bf16_run(seq_len: int) -> bool:
    """Whether a bf16 CPU training run at seq_len tokens attends here (what minituner.planner counts)."""
    return seq_len <= MAX_TOKENS and kernels() is not None


def keeps_probabilities(n_head: int, n_kv_head: int, seq_len: int, head_dim: int) -> bool:
    """Whether attention keeps its bf16 probabilities P (B·h·T² values) for backward rather than recomputing them
    from the logsumexp: on the GEMM path where P is no larger than the grouped q, k and v it keeps anyway, h·T <=
    (h + 2·kv)·d (the saved bytes at most double); never in ``minigpt.fused_attention`` (CPUs with bf16 units,
    which recomputes each block's P where it needs it). ``minituner.planner`` asks the same."""
    return n_head * seq_len <= (n_head + 2 * n_kv_head) * head_dim and not fused_attention.head_fits(head_dim)


def _chunks(q_shape: torch.Size, kv: int) -> list[tuple[int, int]]:
    """[g0, g1) ranges of q's B·kv K/V groups whose bf16 scores take at most CHUNK_BYTES together, and no more
    than q (B, h, T, d) itself (a small model's S stays below its own activations), at least one group each."""
    B, h, T, d = q_shape
    groups, group_bytes = B * kv, (h // kv) * T * T * 2
    per = max(1, min(CHUNK_BYTES, q_shape.numel() * 2) // group_bytes)
    return [(g0, min(groups, g0 + per)) for g0 in range(0, groups, per)]


def _as_groups(x: Tensor, kv: int) -> Tensor:
    """(B, n, T, d) -> (B·kv, n / kv · T, d) contiguous: each K/V head's query heads stacked as rows."""
    B, n, T, d = x.shape
    return x.reshape(B * kv, (n // kv) * T, d).contiguous()


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
        lib = kernels()
        B, h, T, d = q.shape
        kv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        qg, kg, vg = _as_groups(q, kv), _as_groups(k, kv), _as_groups(v, kv)
        out = torch.empty(B * kv, qg.shape[1], d, dtype=q.dtype)  # (B, h, T, d) in memory
        lse = torch.empty(B * h * T, dtype=torch.float32)
        rows = qg.shape[1]
        kept = torch.empty(B * kv, rows, T, dtype=q.dtype) if keeps_probabilities(h, kv, T, d) else None  # P
        for g0, g1 in _chunks(q.shape, kv):
            into = None if kept is None else kept[g0:g1]
            s = torch.bmm(qg[g0:g1], kg[g0:g1].transpose(1, 2), out=into)  # (G, g·T, T) bf16
            lib.softmax_(s, T, window, scale, lse[g0 * rows:g1 * rows], have_lse=False)
            torch.bmm(s, vg[g0:g1], out=out[g0:g1])
        y = torch.empty(B, T, h, d, dtype=q.dtype)  # laid out as the fused kernel lays it out
        y.copy_(out.view(B, h, T, d).transpose(1, 2))
        y = y.transpose(1, 2)  # (B, h, T, d)
        # grouped: backward's GEMMs read them so, and q, k, v are freed; P where kept, else what recomputes it
        ctx.save_for_backward(qg, kg, vg, lse if kept is None else kept)
        ctx.window, ctx.shapes, ctx.kept = window, (q.shape, k.shape), kept is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels write in place, unseen by autograd
    def backward(ctx, dy: Tensor):
        qg, kg, vg, lse_or_p = ctx.saved_tensors
        lib = kernels()
        (B, h, T, d), (_, kv, _, _) = ctx.shapes
        scale = 1.0 / math.sqrt(d)
        dyg = _as_groups(dy.to(qg.dtype), kv)
        dq, dk, dv = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
        rows = qg.shape[1]
        for g0, g1 in _chunks(ctx.shapes[0], kv):
            if ctx.kept:
                p = lse_or_p[g0:g1]  # the forward's P (G, g·T, T)
            else:  # S again, then P over it from the logsumexp
                p = torch.bmm(qg[g0:g1], kg[g0:g1].transpose(1, 2))
                lib.softmax_(p, T, ctx.window, scale, lse_or_p[g0 * rows:g1 * rows], have_lse=True)
            torch.bmm(p.transpose(1, 2), dyg[g0:g1], out=dv[g0:g1])
            ds = torch.bmm(dyg[g0:g1], vg[g0:g1].transpose(1, 2))  # dP, then dS over it
            lib.softmax_grad_(p, ds, T, ctx.window, scale)
            del p
            torch.bmm(ds, kg[g0:g1], out=dq[g0:g1])
            torch.bmm(ds.transpose(1, 2), qg[g0:g1], out=dk[g0:g1])
        return dq.view(B, h, T, d), dk.view(B, kv, T, d), dv.view(B, kv, T, d), None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """softmax(q·kᵀ/√d, causal; at most `window` keys back, itself included) · v for bf16 on CPU (``fits``).

    q (B, h, T, d), k and v (B, kv, T, d) with kv dividing h -> (B, h, T, d). On a CPU with bf16 units (AVX512-BF16
    or AMX), heads whose width is a multiple of 32 attend in one C call (``minigpt.fused_attention``: the same
    roundings, S never in memory)."""
    window = 0 if window is None else int(window)
    if fused_attention.fits(q, k, v):
        return fused_attention.causal_attention(q, k, v, window)
    return _CausalAttention.apply(q, k, v, window)

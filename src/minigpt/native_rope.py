"""Rotary positions on q and k for bf16 on CPU: one pass of C for both forward, one backward.

    if fits(q, k, cos, sin_signed):                # bf16 on CPU, head width a multiple of 32, the kernels built
        q, k = rope_qk(q, k, cos, sin_signed)      # what apply_rope gives for each, to the bit

``minigpt.decoder.apply_rope`` is x·cos + swap_halves(x)·signed_sin(sin) as PyTorch ops: forward a product, a
chunk and a cat, another product and a sum, for q and again for k; backward two products, the cat's and chunk's
slices and copies, and autograd's sum of the two gradients, each op a pass over (B, heads, T, d) and an autograd
node. Here each direction is one C call over the rows of q and k together. The arithmetic is PyTorch's, rounded
where its bf16 ops round, so the bits are the same (tested against the ops and their autograd):

- forward, per row x of d values (halves x₁, x₂) at position t: y₁ = bf16(bf16(x₁·c₁) + bf16(x₂·s₁)),
  y₂ = bf16(bf16(x₂·c₂) + bf16(x₁·s₂)), c = cos[t], s = signed_sin(sin)[t] (its first half negated);
- backward, per row g: dx₁ = bf16(bf16(g₁·c₁) + bf16(g₂·s₂)), dx₂ = bf16(bf16(g₂·c₂) + bf16(g₁·s₁)) (x·cos's
  gradient plus the swapped gradient of swap_halves(x)·s, which autograd adds).

Each product of two bf16 values is exact in fp32 and each sum is rounded to fp32 first, as PyTorch's kernels do;
a NaN comes out as 0x7FC0 (PyTorch's scalar rule; its vectorized ops write 0xFFFF: both NaN). q and k are read
where they lie (any strides, d contiguous: the projections' (B, T, heads, d) seen as (B, heads, T, d)); the
outputs are laid out (B, T, heads, d), as PyTorch's ops lay out theirs for such a view, so o_proj's and the
projections' reshapes stay views. Nothing is saved for backward but cos and sin (the model's one table, which
``minituner.planner`` counts once, as for the ops). Used where the C was built with AVX-512 (``rope_vectorized``)
and d is a multiple of 32; elsewhere (and for fp32, fp16 and CUDA) the decoder runs ``apply_rope``.

On the bench's Llama-3.2-1B-shaped bf16 QLoRA step (benchmarks/bench_bf16.py: 6 layers, 512 tokens, 32 query and
8 K/V heads of 64; Intel Xeon with AMX, 2 threads, 2026-12-06; 40 paced turns, the two in processes of their own,
alternating) the step took 1,228.7 ms against 1,243.0 with the PyTorch ops (medians; turn by turn 0.98x, the
machine's pace moving both from 0.5x to 1.9x of each other), 7,500 fewer page faults a step.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C, BF16_SIGMOID_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, parallel_entry

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]
MIN_VALUES_PER_THREAD = 1 << 16  # fewer values stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 16  # threads take rows in chunks of about this many values

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + BF16_SIGMOID_C + r"""
int rope_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
static inline __m512 mul_rounded(__m512 a, const uint16_t* b) { return round16(_mm512_mul_ps(a, load16(b))); }

/* one row of d values (d a multiple of 32) from x into y, position t's cos c and signed sine s (d values each):
   forward y₁ = x₁c₁ + x₂s₁, y₂ = x₂c₂ + x₁s₂; backward (x the gradient) y₁ = x₁c₁ + x₂s₂, y₂ = x₂c₂ + x₁s₁; each
   product and the sum rounded to bf16 */
static inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t d, int backward,
                            uint16_t* y) {
    const int64_t h = d / 2;
    for (int64_t j = 0; j < h; j += 16) {
        const __m512 x1 = load16(x + j), x2 = load16(x + h + j);
        const uint16_t* s_for1 = backward ? s + h + j : s + j;
        const uint16_t* s_for2 = backward ? s + j : s + h + j;
        store16(y + j, _mm512_add_ps(mul_rounded(x1, c + j), mul_rounded(x2, s_for1)));
        store16(y + h + j, _mm512_add_ps(mul_rounded(x2, c + h + j), mul_rounded(x1, s_for2)));
    }
}
#endif

/* rows [r0, r1) of q's rows then k's: row r < Hq·T·B of q is (b, t, h) = (r / (T·Hq), r / Hq % T, r % Hq), read at
   q + b·qb + h·qh + t·qt and written at qo + r·d; row r - Hq·T·B of k likewise with its strides, Hk and ko.
   Position t's tables at c + t·d and s + t·d */
void rope_rows(const uint16_t* q, int64_t qb, int64_t qh, int64_t qt, int64_t Hq, uint16_t* qo, const uint16_t* k,
               int64_t kb, int64_t kh, int64_t kt, int64_t Hk, uint16_t* ko, int64_t B, int64_t T, int64_t d,
               const uint16_t* c, const uint16_t* s, int backward, int64_t r0, int64_t r1) {
#ifdef __AVX512F__
    const int64_t nq = B * T * Hq;
    for (int64_t r = r0; r < r1; r++) {
        const int in_q = r < nq;
        const int64_t i = in_q ? r : r - nq, H = in_q ? Hq : Hk;
        const int64_t b = i / (T * H), t = i / H % T, h = i % H;
        const uint16_t* x = in_q ? q + b * qb + h * qh + t * qt : k + b * kb + h * kh + t * kt;
        rope_row(x, c + t * d, s + t * d, d, backward, (in_q ? qo : ko) + i * d);
    }
#endif
}

/* rope_rows over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void rope_rows_parallel(const uint16_t* q, int64_t qb, int64_t qh, int64_t qt, int64_t Hq, uint16_t* qo,
                        const uint16_t* k, int64_t kb, int64_t kh, int64_t kt, int64_t Hk, uint16_t* ko, int64_t B,
                        int64_t T, int64_t d, const uint16_t* c, const uint16_t* s, int backward, int64_t b0,
                        int64_t b1, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1,
                       rope_rows(q, qb, qh, qt, Hq, qo, k, kb, kh, kt, Hk, ko, B, T, d, c, s, backward, r0, r1));
}
"""


class RopeKernels:
    """The compiled kernel, rows split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._rows = lib.rope_rows
        self._rows.argtypes = [ptr, i64, i64, i64, i64, ptr] * 2 + [i64, i64, i64, ptr, ptr, i32, i64, i64]
        self._rows.restype = None
        self._rows_parallel = parallel_entry(lib, self._rows)  # over OpenMP's threads
        self._threads = ThreadSplit("minigpt-rope", openmp=bool(lib.mk_openmp()))

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin_signed: Tensor, backward: bool = False
               ) -> tuple[Tensor, Tensor]:
        """(q', k') for q (B, Hq, T, d) and k (B, Hk, T, d), bf16 with d contiguous, and cos, sin_signed (T, d)
        contiguous: the rotation (backward: its gradient, q and k the outputs' gradients), each laid out
        (B, T, heads, d) and returned as (B, heads, T, d)."""
        B, Hq, T, d = q.shape
        Hk = k.shape[1]
        qo = torch.empty(B, T, Hq, d, dtype=q.dtype)
        ko = torch.empty(B, T, Hk, d, dtype=k.dtype)
        args = (q.data_ptr(), *q.stride()[:3], Hq, qo.data_ptr(), k.data_ptr(), *k.stride()[:3], Hk, ko.data_ptr(),
                B, T, d, cos.data_ptr(), sin_signed.data_ptr(), int(backward))  # (b, head, t) strides in values
        self._threads.run(B * T * (Hq + Hk), d, lambda r0, r1: self._rows(*args, r0, r1), MIN_VALUES_PER_THREAD,
                          CHUNK_VALUES, lambda r0, r1, c, t: self._rows_parallel(*args, r0, r1, c, t))
        return qo.transpose(1, 2), ko.transpose(1, 2)


_FAMILY = KernelFamily("bf16_rope", _SOURCE, CFLAGS, "minigpt's native RoPE kernel", RopeKernels, LIBS,
                       vectorized="rope_vectorized", parallel=True)


def kernels() -> RopeKernels | None:
    """The native RoPE kernel, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()


def fits(q: Tensor, k: Tensor, cos: Tensor, sin_signed: Tensor) -> bool:
    """Whether rope_qk takes these: q (B, Hq, T, d) and k (B, Hk, T, d) bf16 on CPU with d contiguous and a multiple
    of 32, cos and sin_signed (T, d) bf16 and contiguous, and the kernel built."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 2:
        return False
    B, _, T, d = q.shape
    return (q.dtype == k.dtype == cos.dtype == sin_signed.dtype == torch.bfloat16
            and q.device.type == k.device.type == cos.device.type == sin_signed.device.type == "cpu"
            and k.shape[0] == B and k.shape[2:] == (T, d) and cos.shape == sin_signed.shape == (T, d)
            and d % 32 == 0 and q.stride(3) == 1 and k.stride(3) == 1
            and cos.is_contiguous() and sin_signed.is_contiguous() and kernels() is not None)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin_signed)
        return kernels().rotate(q, k, cos, sin_signed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq: Tensor, dk: Tensor):  # (an output without a gradient gets zeros: materialize_grads)
        cos, sin_signed = ctx.saved_tensors
        dq, dk = (g if g.stride(3) == 1 else g.contiguous() for g in (dq, dk))
        dq, dk = kernels().rotate(dq, dk, cos, sin_signed, backward=True)
        return dq, dk, None, None


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor]:
    """(apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)) for bf16 on CPU (``fits``), one C call each
    way."""
    return _RopeQK.apply(q, k, cos, sin_signed)

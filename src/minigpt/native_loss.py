"""The bf16 cross-entropy's two passes as one native kernel each (C compiled on first use, rows on threads).

    k = kernels()                                  # None: no compiler, the build failed, or MINIQUANT_NATIVE=0
    lse = k.logsumexp(logits)                      # (N, V) bf16 -> (N,) fp32: log Σ_v exp(z_v), per row
    grad = k.softmax_grad(logits, lse, targets, row_scale)   # (N, V) bf16: (softmax - one-hot(target)) · scale

``minigpt.cross_entropy.ChunkedCrossEntropy`` calls these for contiguous bf16 logits on CPU; elsewhere
(fp16, CUDA, no compiler) it runs the same arithmetic as PyTorch ops a few rows at a time. Per row the
kernel reads the bf16 logits once for the maximum and once for Σ exp(z - max) (fp32), and in the backward
once more, writing each gradient value once, rounded to bf16 (round to nearest even): no fp32 (N, V)
tensor and no fp32 chunk in memory, where the PyTorch path makes and reads several.
Both passes read ahead in software (``minikernels.stream_prefetch``): the gradient, written over the logits
in a training step, took 48.8 ms without at Llama 3's vocabulary and 512 tokens, 12.6 ms with it (2 threads,
Intel Xeon with AMX, 2026-12-06).

exp and the bf16 roundings are ``minikernels.bf16_exp``'s (Cephes' expf: the same bits on AVX-512 and in
plain C); -inf logits (masked tokens) are exact zeros in the sum. A row with a NaN or +inf logit, or only
-inf, goes through libm's expf and logf with PyTorch's logsumexp rule (the maximum taken as 0 when it is
infinite), so such rows give PyTorch's NaN, inf and -inf. The kernels are used only where they were built with AVX-512 (``ce_vectorized``):
a plain-C row sum is one sequential chain, slower than PyTorch's ops and less accurate over 128K values.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, fresh_tensor, parallel_entry
from minikernels.stream_prefetch import STREAM_PREFETCH_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]  # expf, logf
MIN_VALUES_PER_THREAD = 1 << 18  # fewer logits stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 18  # threads take rows in chunks of about this many values, as they get free

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + STREAM_PREFETCH_C + r"""
/* 1 when built with AVX-512 (the 16-lane loops below); without it the kernels are not used: a plain-C row
   sum is one sequential chain, slower than PyTorch's ops and less accurate at a 128K-token row */
int ce_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* log Σ exp over a row with an inf or NaN: PyTorch's logsumexp (an infinite maximum taken as 0) */
static float lse_special(const uint16_t* z, int64_t vocab) {
    float m = -INFINITY;
    for (int64_t j = 0; j < vocab; j++) { float x = f32_from_bf16(z[j]); if (x > m || x != x) m = x; }
    if (m != m) return m;
    if (isinf(m)) m = 0.0f;
    float s = 0.0f;
    for (int64_t j = 0; j < vocab; j++) s += expf(f32_from_bf16(z[j]) - m);
    return logf(s) + m;
}

/* lse[r] = log Σ_j exp(z[r, j]) for rows [r0, r1) of z (rows `ld` values apart) */
void ce_logsumexp(const uint16_t* z, int64_t ld, int64_t vocab, int64_t r0, int64_t r1, float* lse) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t* row = z + r * ld;
        float m = -INFINITY;
        int special = 0;
        int64_t j = 0;
#ifdef __AVX512F__
        __m512 mv = _mm512_set1_ps(-INFINITY);
        const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
        const __m512i minus_inf = _mm512_set1_epi32((int)0xFF800000u);
        __mmask16 seen = 0;  /* lanes that saw NaN or +inf (-inf is an ordinary 0 in the sum) */
        for (; j + 16 <= vocab; j += 16) {
            if ((j & 31) == 0) prefetch_ahead(row + j);  /* once a 64-byte line (stream_prefetch) */
            __m512 x = load16(row + j);
            __m512i u = _mm512_castps_si512(x);
            mv = _mm512_max_ps(mv, x);
            seen |= _mm512_mask_cmpneq_epi32_mask(_mm512_cmpge_epu32_mask(_mm512_and_si512(u, magnitude), inf),
                                                  u, minus_inf);
        }
        m = _mm512_reduce_max_ps(mv);
        special = seen != 0;
#endif
        for (; j < vocab; j++) {
            uint16_t h = row[j];
            if ((h & 0x7FFFu) >= 0x7F80u && h != 0xFF80u) special = 1;  /* NaN or +inf */
            float x = f32_from_bf16(h);
            if (x > m) m = x;
        }
        if (special || m == -INFINITY) { lse[r] = lse_special(row, vocab); continue; }  /* torch's inf, NaN, -inf */
        float s = 0.0f;
        j = 0;
#ifdef __AVX512F__
        /* four running sums of 16 lanes: 64 partial sums per row (accuracy, and four independent chains) */
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, mb = _mm512_set1_ps(m);
        for (; j + 64 <= vocab; j += 64) {
            s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(load16(row + j), mb)));
            s1 = _mm512_add_ps(s1, exp16(_mm512_sub_ps(load16(row + j + 16), mb)));
            s2 = _mm512_add_ps(s2, exp16(_mm512_sub_ps(load16(row + j + 32), mb)));
            s3 = _mm512_add_ps(s3, exp16(_mm512_sub_ps(load16(row + j + 48), mb)));
        }
        for (; j + 16 <= vocab; j += 16) s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(load16(row + j), mb)));
        s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#endif
        for (; j < vocab; j++) s += exp_nonpos(f32_from_bf16(row[j]) - m);
        lse[r] = logf(s) + m;
    }
}

/* out[r, j] = (exp(z[r, j] - lse[r]) - [j == target[r]]) * scale[r], rounded to bf16, rows [r0, r1);
   target < 0: no one-hot (a row that does not count; its scale is 0). out may be z itself: each value is read
   before its gradient is written over it (the target's first of all) */
void ce_softmax_grad(const uint16_t* z, int64_t ld, int64_t vocab, const float* lse, const int64_t* target,
                     const float* scale, int64_t r0, int64_t r1, uint16_t* out, int64_t out_ld) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t* row = z + r * ld;
        uint16_t* o = out + r * out_ld;
        float l = lse[r], sc = scale[r];
        int64_t t = target[r];
        float zt = t >= 0 ? f32_from_bf16(row[t]) : 0.0f;
        int64_t j = 0;
        if (isfinite(l)) {
#ifdef __AVX512F__
            __m512 lb = _mm512_set1_ps(l), sb = _mm512_set1_ps(sc);
            for (; j + 16 <= vocab; j += 16) {
                if ((j & 31) == 0) prefetch_ahead(row + j);  /* once a 64-byte line (stream_prefetch) */
                __m512 x = _mm512_min_ps(_mm512_sub_ps(load16(row + j), lb), _mm512_setzero_ps());
                store16(o + j, _mm512_mul_ps(exp16(x), sb));
            }
#endif
            for (; j < vocab; j++) {
                float x = f32_from_bf16(row[j]) - l;
                o[j] = bf16_from_f32(exp_nonpos(x < 0.0f ? x : 0.0f) * sc);
            }
        } else {
            for (; j < vocab; j++) o[j] = bf16_from_f32(expf(f32_from_bf16(row[j]) - l) * sc);
        }
        if (t >= 0) {
            float x = zt - l;
            float p = isfinite(l) ? exp_nonpos(x < 0.0f ? x : 0.0f) : expf(x);
            o[t] = bf16_from_f32((p - 1.0f) * sc);
        }
    }
}

/* the two above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void ce_logsumexp_parallel(const uint16_t* z, int64_t ld, int64_t vocab, int64_t b0, int64_t b1, float* lse,
                           int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ce_logsumexp(z, ld, vocab, r0, r1, lse));
}

void ce_softmax_grad_parallel(const uint16_t* z, int64_t ld, int64_t vocab, const float* lse, const int64_t* target,
                              const float* scale, int64_t b0, int64_t b1, uint16_t* out, int64_t out_ld,
                              int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ce_softmax_grad(z, ld, vocab, lse, target, scale, r0, r1, out, out_ld));
}
"""


class LossKernels:
    """The compiled kernels, with rows split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._lse = lib.ce_logsumexp
        self._lse.argtypes = [ptr, i64, i64, i64, i64, ptr]
        self._lse.restype = None
        self._lse_parallel = parallel_entry(lib, self._lse)  # over OpenMP's threads
        self._grad = lib.ce_softmax_grad
        self._grad.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64]
        self._grad.restype = None
        self._grad_parallel = parallel_entry(lib, self._grad)  # over OpenMP's threads
        self._threads = ThreadSplit("minigpt-loss", openmp=bool(lib.mk_openmp()))

    @staticmethod
    def fits(logits: Tensor) -> bool:
        """Whether these kernels take these logits: bf16 (N, V) on CPU, each row contiguous."""
        return (logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2
                and logits.stride(1) == 1)

    def logsumexp(self, logits: Tensor) -> Tensor:
        """(N, V) bf16 -> (N,) fp32 log Σ_v exp(z_v) of each row."""
        n, vocab = logits.shape
        lse = torch.empty(n, dtype=torch.float32)
        z, ld = logits.data_ptr(), logits.stride(0)
        self._threads.run(n, vocab, lambda r0, r1: self._lse(z, ld, vocab, r0, r1, lse.data_ptr()),
                          MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda r0, r1, c, t: self._lse_parallel(z, ld, vocab, r0, r1, lse.data_ptr(), c, t))
        return lse

    def softmax_grad(self, logits: Tensor, lse: Tensor, targets: Tensor, row_scale: Tensor,
                     out: Tensor | None = None) -> Tensor:
        """(N, V) bf16: (exp(z - lse) - one-hot(target)) · row_scale per row; a target < 0 has no one-hot.

        Written into `out` when given ((N, V) bf16, rows contiguous; the logits themselves may be it: each value
        is read before its gradient overwrites it), else into a fresh tensor."""
        n, vocab = logits.shape
        if not (lse.numel() == targets.numel() == row_scale.numel() == n):
            raise ValueError(f"{n} rows need {n} lse, targets and scales, got {lse.numel()}, {targets.numel()}, "
                             f"{row_scale.numel()}")
        if n and int(targets.max()) >= vocab:  # the kernel writes at each target: never past a row
            raise ValueError(f"target {int(targets.max())} is out of range for {vocab} logits")
        if out is None:
            out = fresh_tensor((n, vocab), torch.bfloat16)
        elif not self.fits(out) or out.shape != logits.shape:
            raise ValueError(f"the gradient of ({n}, {vocab}) bf16 logits needs an out of that shape and dtype, rows "
                             f"contiguous; got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
        lse, targets = lse.contiguous().float(), targets.contiguous().long()
        row_scale = row_scale.contiguous().float()
        args = (logits.data_ptr(), logits.stride(0), vocab, lse.data_ptr(), targets.data_ptr(), row_scale.data_ptr())
        tail = (out.data_ptr(), out.stride(0))
        self._threads.run(n, vocab, lambda r0, r1: self._grad(*args, r0, r1, *tail), MIN_VALUES_PER_THREAD,
                          CHUNK_VALUES, lambda r0, r1, c, t: self._grad_parallel(*args, r0, r1, *tail, c, t))
        return out


_FAMILY = KernelFamily("bf16_loss", _SOURCE, CFLAGS, "minigpt's native loss kernels", LossKernels,
                       LIBS, vectorized="ce_vectorized", parallel=True)
_usable = _FAMILY.usable  # None for a library built without AVX-512


def takes_bf16_logits() -> bool:
    """Whether a bf16 CPU training run's loss runs here (what minituner.planner counts: no fp32 chunk)."""
    return kernels() is not None


def kernels() -> LossKernels | None:
    """The native loss kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()

"""RMSNorm and LayerNorm on the fp32 residual stream handing out bf16, for bf16 compute on CPU: one pass of C each way.

    if fits(x, weight):                      # fp32 (..., C) on CPU, a frozen fp32 weight, kernels built
        y = rms_norm_bf16(x, weight, eps)    # (..., C) bf16: weight · x / sqrt(mean(x²) + eps), rounded once
    if layer_norm_fits(x, weight, bias):     # the same, weight and bias frozen fp32 (C,) or None
        y = layer_norm_bf16(x, weight, bias, eps)   # (..., C) bf16: F.layer_norm(x, (C,), ...) rounded once
    if add_fits(x, branch):                  # and the norm's own test: the residual add fused in front of it
        x, y = add_layer_norm_bf16(x, branch, weight, bias, eps)   # (x + branch, layer_norm_bf16(x + branch))

What it computes is ``RMSNorm(x).to(bfloat16)`` of ``minigpt.decoder`` (transformers' LlamaRMSNorm followed by
the cast to the products' dtype that ``minituner.precision`` adds): per row rstd = 1 / sqrt(Σ x² / C + eps) in
fp32, then y = bf16(w · (x · rstd)). As PyTorch ops that is five passes over the row forward and about ten
backward (pow, mean, rsqrt, two products, the cast, and each one's gradient); on a 2-core CPU at Llama-3.2-1B's
width (512 × 2048) about 3 ms a norm forward and backward, 33 norms a step.

Backward, for a frozen weight (bf16 compute never trains one): with g = grad_y · w (fp32) per row,
grad_x = rstd · g - x · rstd³ · (Σ g · x) / C. It saves what the PyTorch ops save: x (the stream tensor itself)
and rstd (one fp32 per row), so ``minituner.planner``'s terms (``rmsnorm input``, ``rmsnorm rstd``) hold as they
are. Sums run in 16 fp32 lanes, so results differ from PyTorch's in the last fp32 bits (the bf16 output almost
never). NaN and inf in a row propagate as in the PyTorch ops.

LayerNorm (MiniGPT's and GPT-2's ``ln_1``, ``ln_2``, ``ln_f``) is ``F.layer_norm(x).to(bfloat16)``: per row the
mean, then rstd = 1 / sqrt(Σ (x - mean)² / C + eps) (a second pass, as accurate as PyTorch's moments), and
y = bf16((x - mean) · rstd · w + b). Backward, w and b frozen: with x̂ = (x - mean) · rstd and g = grad_y · w,
grad_x = rstd · (g - Σ g / C - x̂ · Σ (g · x̂) / C). It saves x, the mean and rstd, as ``F.layer_norm`` does
(the planner's ``layernorm input`` and ``layernorm mean/rstd``). As PyTorch ops and a cast: 0.67 ms a norm
forward and backward at the bench's GPT shape (1,024 × 512, AMD EPYC, 2 cores), 0.23 ms here; a GPT-2-small-shaped
bf16 LoRA step (2 × 512 tokens, 25 norms) took 968 ms with these kernels and 992 ms without (medians of 7 steps,
the two models alternating in one process, 2026-12-03).

The residual add before each norm but the first block's (``minigpt.residual.add_then_norm``; a block's last add
joins the next block's first norm, the last block's the final norm) joins it: ``add_rms_norm_bf16``
and ``add_layer_norm_bf16`` take the fp32 stream x and the bf16 branch and return (x + branch, the norm of it), each
row added in fp32 (exactly what PyTorch's type promotion adds) and normed while it is in cache; backward adds
the gradient that reached the sum directly to the norm's and hands the branch that sum rounded to bf16, in the
same pass. Where PyTorch's add, the norm and autograd's sum and cast take four passes each way, this takes one;
the bits are the same (tested). It saves what the norm alone saves (the add saves nothing). Forward and backward
at the bench's GPT shape (1,024 × 512): about 0.32 ms against 0.48 unfused for LayerNorm, 0.28 against 0.51 for
RMSNorm (medians of 50 calls, AMD EPYC, 2 cores, 2026-12-04).

Used only where the C was built with AVX-512 (``norm_vectorized``); elsewhere, for fp16, CUDA or a weight that
trains, the norms run their PyTorch ops.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, parallel_entry

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]  # sqrtf
MIN_VALUES_PER_THREAD = 1 << 16  # fewer values stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 16  # threads take rows in chunks of about this many values

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + r"""
int norm_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Rows [r0, r1) of x (fp32, C each, contiguous): rstd[r] = 1 / sqrt(Σ x² / C + eps), y = bf16(w · (x · rstd)) */
void rms_forward(const float* x, const float* w, int64_t C, float eps, int64_t r0, int64_t r1,
                 uint16_t* y, float* rstd) {
    for (int64_t r = r0; r < r1; r++) {
        const float* row = x + r * C;
        uint16_t* out = y + r * C;
        int64_t j = 0;
        float ss = 0.0f;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) {
            __m512 v = _mm512_loadu_ps(row + j);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; j < C; j++) ss += row[j] * row[j];
        float rs = 1.0f / sqrtf(ss / (float)C + eps);
        rstd[r] = rs;
        j = 0;
#ifdef __AVX512F__
        __m512 vr = _mm512_set1_ps(rs);
        for (; j + 16 <= C; j += 16)
            store16(out + j, _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(row + j), vr)));
#endif
        for (; j < C; j++) out[j] = bf16_from_f32(w[j] * (row[j] * rs));
    }
}

/* Rows [r0, r1): gx = rstd · g - x · rstd³ · (Σ g · x) / C with g = gy · w (gy bf16, the rest fp32) */
void rms_backward(const uint16_t* gy, const float* x, const float* w, const float* rstd, int64_t C,
                  int64_t r0, int64_t r1, float* gx) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t* grow = gy + r * C;
        const float* row = x + r * C;
        float* out = gx + r * C;
        int64_t j = 0;
        float dot = 0.0f;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) {
            __m512 g = _mm512_mul_ps(load16(grow + j), _mm512_loadu_ps(w + j));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(g, _mm512_loadu_ps(row + j)));
        }
        dot = _mm512_reduce_add_ps(acc);
#endif
        for (; j < C; j++) dot += f32_from_bf16(grow[j]) * w[j] * row[j];
        float rs = rstd[r];
        float c = rs * rs * rs * dot / (float)C;
        j = 0;
#ifdef __AVX512F__
        __m512 vr = _mm512_set1_ps(rs), vc = _mm512_set1_ps(c);
        for (; j + 16 <= C; j += 16) {
            __m512 g = _mm512_mul_ps(load16(grow + j), _mm512_loadu_ps(w + j));
            _mm512_storeu_ps(out + j, _mm512_sub_ps(_mm512_mul_ps(vr, g), _mm512_mul_ps(_mm512_loadu_ps(row + j), vc)));
        }
#endif
        for (; j < C; j++) out[j] = rs * (f32_from_bf16(grow[j]) * w[j]) - row[j] * c;
    }
}

/* LayerNorm. Rows [r0, r1) of x (fp32, C each, contiguous): mean[r], rstd[r] = 1 / sqrt(Σ (x - mean)² / C + eps)
   (two passes over the row), y = bf16((x - mean) · rstd · w + b); w or b NULL: 1 or 0 */
void ln_forward(const float* x, const float* w, const float* b, int64_t C, float eps, int64_t r0, int64_t r1,
                uint16_t* y, float* mean, float* rstd) {
    for (int64_t r = r0; r < r1; r++) {
        const float* row = x + r * C;
        uint16_t* out = y + r * C;
        int64_t j = 0;
        float sum = 0.0f, ss = 0.0f;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(row + j));
        sum = _mm512_reduce_add_ps(acc);
#endif
        for (; j < C; j++) sum += row[j];
        float mu = sum / (float)C;
        j = 0;
#ifdef __AVX512F__
        __m512 vmu = _mm512_set1_ps(mu);
        acc = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) {
            __m512 d = _mm512_sub_ps(_mm512_loadu_ps(row + j), vmu);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(d, d));
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; j < C; j++) ss += (row[j] - mu) * (row[j] - mu);
        float rs = 1.0f / sqrtf(ss / (float)C + eps);
        mean[r] = mu;
        rstd[r] = rs;
        j = 0;
#ifdef __AVX512F__
        __m512 vr = _mm512_set1_ps(rs), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) {
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmu), vr);
            v = _mm512_mul_ps(v, w ? _mm512_loadu_ps(w + j) : one);
            store16(out + j, _mm512_add_ps(v, b ? _mm512_loadu_ps(b + j) : zero));
        }
#endif
        for (; j < C; j++) out[j] = bf16_from_f32((row[j] - mu) * rs * (w ? w[j] : 1.0f) + (b ? b[j] : 0.0f));
    }
}

/* Rows [r0, r1): with xhat = (x - mean) · rstd and g = gy · w (gy bf16; w NULL: 1):
   gx = rstd · (g - Σ g / C - xhat · Σ (g · xhat) / C) */
void ln_backward(const uint16_t* gy, const float* x, const float* w, const float* mean, const float* rstd, int64_t C,
                 int64_t r0, int64_t r1, float* gx) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t* grow = gy + r * C;
        const float* row = x + r * C;
        float* out = gx + r * C;
        float mu = mean[r], rs = rstd[r];
        int64_t j = 0;
        float sg = 0.0f, sgx = 0.0f;
#ifdef __AVX512F__
        __m512 vmu = _mm512_set1_ps(mu), vr = _mm512_set1_ps(rs), one = _mm512_set1_ps(1.0f);
        __m512 acc_g = _mm512_setzero_ps(), acc_gx = _mm512_setzero_ps();
        for (; j + 16 <= C; j += 16) {
            __m512 g = _mm512_mul_ps(load16(grow + j), w ? _mm512_loadu_ps(w + j) : one);
            __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmu), vr);
            acc_g = _mm512_add_ps(acc_g, g);
            acc_gx = _mm512_add_ps(acc_gx, _mm512_mul_ps(g, xh));
        }
        sg = _mm512_reduce_add_ps(acc_g);
        sgx = _mm512_reduce_add_ps(acc_gx);
#endif
        for (; j < C; j++) {
            float g = f32_from_bf16(grow[j]) * (w ? w[j] : 1.0f);
            sg += g;
            sgx += g * ((row[j] - mu) * rs);
        }
        float mg = sg / (float)C, mgx = sgx / (float)C;
        j = 0;
#ifdef __AVX512F__
        __m512 vmg = _mm512_set1_ps(mg), vmgx = _mm512_set1_ps(mgx);
        for (; j + 16 <= C; j += 16) {
            __m512 g = _mm512_mul_ps(load16(grow + j), w ? _mm512_loadu_ps(w + j) : one);
            __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmu), vr);
            _mm512_storeu_ps(out + j, _mm512_mul_ps(vr, _mm512_sub_ps(_mm512_sub_ps(g, vmg), _mm512_mul_ps(xh, vmgx))));
        }
#endif
        for (; j < C; j++) {
            float g = f32_from_bf16(grow[j]) * (w ? w[j] : 1.0f);
            out[j] = rs * (g - mg - ((row[j] - mu) * rs) * mgx);
        }
    }
}

/* The residual add before a norm, fused with it. Rows [r0, r1): xo = x + br (br bf16, added exactly in fp32, as
   PyTorch's type promotion adds it), then rms_forward / ln_forward on xo's row while it is in cache */
static inline void add_row(const float* x, const uint16_t* br, int64_t C, float* xo) {
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= C; j += 16) _mm512_storeu_ps(xo + j, _mm512_add_ps(_mm512_loadu_ps(x + j), load16(br + j)));
#endif
    for (; j < C; j++) xo[j] = x[j] + f32_from_bf16(br[j]);
}

void rms_add_forward(const float* x, const uint16_t* br, const float* w, int64_t C, float eps, int64_t r0, int64_t r1,
                     float* xo, uint16_t* y, float* rstd) {
    for (int64_t r = r0; r < r1; r++) {
        add_row(x + r * C, br + r * C, C, xo + r * C);
        rms_forward(xo, w, C, eps, r, r + 1, y, rstd);
    }
}

void ln_add_forward(const float* x, const uint16_t* br, const float* w, const float* b, int64_t C, float eps,
                    int64_t r0, int64_t r1, float* xo, uint16_t* y, float* mean, float* rstd) {
    for (int64_t r = r0; r < r1; r++) {
        add_row(x + r * C, br + r * C, C, xo + r * C);
        ln_forward(xo, w, b, C, eps, r, r + 1, y, mean, rstd);
    }
}

/* Its backward, row by row after rms_backward / ln_backward wrote gx: gx += gres (the gradient that reached the
   sum directly; NULL: none), then gb = bf16(gx), the branch's gradient (what PyTorch's add and cast hand back) */
static inline void add_grad_row(const float* gres, int64_t C, float* gx, uint16_t* gb) {
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= C; j += 16) {
        __m512 v = _mm512_loadu_ps(gx + j);
        if (gres) {
            v = _mm512_add_ps(v, _mm512_loadu_ps(gres + j));
            _mm512_storeu_ps(gx + j, v);
        }
        store16(gb + j, v);
    }
#endif
    for (; j < C; j++) {
        if (gres) gx[j] += gres[j];
        gb[j] = bf16_from_f32(gx[j]);
    }
}

void rms_add_backward(const uint16_t* gy, const float* gres, const float* x, const float* w, const float* rstd,
                      int64_t C, int64_t r0, int64_t r1, float* gx, uint16_t* gb) {
    for (int64_t r = r0; r < r1; r++) {
        rms_backward(gy, x, w, rstd, C, r, r + 1, gx);
        add_grad_row(gres ? gres + r * C : NULL, C, gx + r * C, gb + r * C);
    }
}

void ln_add_backward(const uint16_t* gy, const float* gres, const float* x, const float* w, const float* mean,
                     const float* rstd, int64_t C, int64_t r0, int64_t r1, float* gx, uint16_t* gb) {
    for (int64_t r = r0; r < r1; r++) {
        ln_backward(gy, x, w, mean, rstd, C, r, r + 1, gx);
        add_grad_row(gres ? gres + r * C : NULL, C, gx + r * C, gb + r * C);
    }
}

/* the eight above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void rms_forward_parallel(const float* x, const float* w, int64_t C, float eps, int64_t b0, int64_t b1,
                          uint16_t* y, float* rstd, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, rms_forward(x, w, C, eps, r0, r1, y, rstd));
}

void rms_backward_parallel(const uint16_t* gy, const float* x, const float* w, const float* rstd, int64_t C,
                           int64_t b0, int64_t b1, float* gx, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, rms_backward(gy, x, w, rstd, C, r0, r1, gx));
}

void ln_forward_parallel(const float* x, const float* w, const float* b, int64_t C, float eps, int64_t b0, int64_t b1,
                         uint16_t* y, float* mean, float* rstd, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ln_forward(x, w, b, C, eps, r0, r1, y, mean, rstd));
}

void ln_backward_parallel(const uint16_t* gy, const float* x, const float* w, const float* mean, const float* rstd,
                          int64_t C, int64_t b0, int64_t b1, float* gx, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ln_backward(gy, x, w, mean, rstd, C, r0, r1, gx));
}

void rms_add_forward_parallel(const float* x, const uint16_t* br, const float* w, int64_t C, float eps, int64_t b0,
                              int64_t b1, float* xo, uint16_t* y, float* rstd, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, rms_add_forward(x, br, w, C, eps, r0, r1, xo, y, rstd));
}

void ln_add_forward_parallel(const float* x, const uint16_t* br, const float* w, const float* b, int64_t C, float eps,
                             int64_t b0, int64_t b1, float* xo, uint16_t* y, float* mean, float* rstd, int64_t chunks,
                             int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ln_add_forward(x, br, w, b, C, eps, r0, r1, xo, y, mean, rstd));
}

void rms_add_backward_parallel(const uint16_t* gy, const float* gres, const float* x, const float* w, const float* rstd,
                               int64_t C, int64_t b0, int64_t b1, float* gx, uint16_t* gb, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, rms_add_backward(gy, gres, x, w, rstd, C, r0, r1, gx, gb));
}

void ln_add_backward_parallel(const uint16_t* gy, const float* gres, const float* x, const float* w, const float* mean,
                              const float* rstd, int64_t C, int64_t b0, int64_t b1, float* gx, uint16_t* gb,
                              int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, ln_add_backward(gy, gres, x, w, mean, rstd, C, r0, r1, gx, gb));
}
"""


class NormKernels:
    """The compiled kernels, rows split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._kernels = {}  # name -> (the C function over rows [r0, r1), its entry over OpenMP's threads)
        for name, argtypes in (("rms_forward", [ptr, ptr, i64, f32, i64, i64, ptr, ptr]),
                               ("rms_backward", [ptr, ptr, ptr, ptr, i64, i64, i64, ptr]),
                               ("ln_forward", [ptr, ptr, ptr, i64, f32, i64, i64, ptr, ptr, ptr]),
                               ("ln_backward", [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr]),
                               # the residual add fused with each norm
                               ("rms_add_forward", [ptr, ptr, ptr, i64, f32, i64, i64, ptr, ptr, ptr]),
                               ("ln_add_forward", [ptr, ptr, ptr, ptr, i64, f32, i64, i64, ptr, ptr, ptr, ptr]),
                               ("rms_add_backward", [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr]),
                               ("ln_add_backward", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            self._kernels[name] = fn, parallel_entry(lib, fn)
        self._threads = ThreadSplit("minigpt-norm", openmp=bool(lib.mk_openmp()))

    def _rows(self, name: str, n: int, c: int, head: tuple, tail: tuple) -> None:
        """Run kernel `name`(*head, r0, r1, *tail) over n rows of c values, split across threads."""
        fn, parallel = self._kernels[name]
        self._threads.run(n, c, lambda r0, r1: fn(*head, r0, r1, *tail), MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda r0, r1, k, t: parallel(*head, r0, r1, *tail, k, t))

    def forward(self, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """x (N, C) fp32 contiguous -> y (N, C) bf16 and rstd (N,) fp32."""
        n, c = x.shape
        y = torch.empty(n, c, dtype=torch.bfloat16)
        rstd = torch.empty(n, dtype=torch.float32)
        self._rows("rms_forward", n, c, (x.data_ptr(), weight.data_ptr(), c, eps), (y.data_ptr(), rstd.data_ptr()))
        return y, rstd

    def backward(self, gy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> Tensor:
        """gy (N, C) bf16, x (N, C) fp32 (both contiguous), rstd (N,) -> grad_x (N, C) fp32."""
        n, c = x.shape
        gx = torch.empty(n, c, dtype=torch.float32)
        self._rows("rms_backward", n, c, (gy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), c),
                   (gx.data_ptr(),))
        return gx

    def layer_norm_forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, C) fp32 contiguous -> y (N, C) bf16, mean (N,) and rstd (N,) fp32."""
        n, c = x.shape
        y = torch.empty(n, c, dtype=torch.bfloat16)
        mean, rstd = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        self._rows("ln_forward", n, c, (x.data_ptr(), _ptr(weight), _ptr(bias), c, eps),
                   (y.data_ptr(), mean.data_ptr(), rstd.data_ptr()))
        return y, mean, rstd

    def layer_norm_backward(self, gy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor) -> Tensor:
        """gy (N, C) bf16, x (N, C) fp32 (both contiguous), mean and rstd (N,) -> grad_x (N, C) fp32."""
        n, c = x.shape
        gx = torch.empty(n, c, dtype=torch.float32)
        head = (gy.data_ptr(), x.data_ptr(), _ptr(weight), mean.data_ptr(), rstd.data_ptr(), c)
        self._rows("ln_backward", n, c, head, (gx.data_ptr(),))
        return gx

    def add_forward(self, x: Tensor, branch: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                    layer_norm: bool) -> tuple[Tensor, ...]:
        """x (N, C) fp32 and branch (N, C) bf16, contiguous -> x + branch (N, C) fp32, the norm of it (N, C) bf16,
        then (LayerNorm) mean and rstd, or (RMSNorm) rstd, (N,) fp32 each."""
        n, c = x.shape
        xo, y = torch.empty_like(x), torch.empty(n, c, dtype=torch.bfloat16)
        stats = tuple(torch.empty(n, dtype=torch.float32) for _ in range(2 if layer_norm else 1))
        affine = (_ptr(weight), _ptr(bias)) if layer_norm else (weight.data_ptr(),)
        self._rows("ln_add_forward" if layer_norm else "rms_add_forward", n, c,
                   (x.data_ptr(), branch.data_ptr(), *affine, c, eps), (xo.data_ptr(), y.data_ptr(),
                                                                         *(t.data_ptr() for t in stats)))
        return (xo, y, *stats)

    def add_backward(self, gy: Tensor, gres: Tensor | None, x: Tensor, weight: Tensor | None,
                     stats: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """gy (N, C) bf16, gres (N, C) fp32 or None, x (N, C) fp32 (the sum), all contiguous, and the forward's
        stats -> the sum's gradient gres + norm's (N, C) fp32 and the same rounded to bf16 (the branch's)."""
        n, c = x.shape
        gx, gb = torch.empty_like(x), torch.empty(n, c, dtype=torch.bfloat16)
        self._rows("ln_add_backward" if len(stats) == 2 else "rms_add_backward", n, c,
                   (gy.data_ptr(), _ptr(gres), x.data_ptr(), _ptr(weight), *(t.data_ptr() for t in stats), c),
                   (gx.data_ptr(), gb.data_ptr()))
        return gx, gb


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_FAMILY = KernelFamily("bf16_norm", _SOURCE, CFLAGS, "minigpt's native RMSNorm and LayerNorm kernels", NormKernels,
                       LIBS, vectorized="norm_vectorized", parallel=True)
_usable = _FAMILY.usable  # None for a library built without AVX-512


def kernels() -> NormKernels | None:
    """The native RMSNorm and LayerNorm kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether rms_norm_bf16 takes these: fp32 x (..., C) contiguous on CPU, an fp32 (C,) weight that does not
    train, and the kernels built."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
            and x.dim() >= 1 and x.is_contiguous() and weight.shape == x.shape[-1:] and weight.is_contiguous()
            and not weight.requires_grad and kernels() is not None)


class _RMSNormBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.view(-1, x.shape[-1])  # (N, C)
        y, rstd = kernels().forward(x2, weight, eps)
        ctx.save_for_backward(x, weight, rstd)  # x: the stream tensor itself, as the PyTorch ops keep it
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        gy2 = gy.to(torch.bfloat16).contiguous().view(-1, x.shape[-1])
        gx = kernels().backward(gy2, x.view(-1, x.shape[-1]), weight, rstd)
        return gx.view(x.shape), None, None


def rms_norm_bf16(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """bf16(weight · x / sqrt(mean(x², -1) + eps)) computed in fp32 (``fits``); x (..., C) -> (..., C) bf16."""
    return _RMSNormBf16.apply(x, weight, float(eps))


def layer_norm_fits(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether layer_norm_bf16 takes these: fp32 x (..., C) contiguous on CPU, fp32 (C,) weight and bias (either
    may be None) that do not train, and the kernels built."""
    affine = [t for t in (weight, bias) if t is not None]
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 and x.is_contiguous()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.shape == x.shape[-1:]
                    and t.is_contiguous() and not t.requires_grad for t in affine)
            and kernels() is not None)


class _LayerNormBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        x2 = x.view(-1, x.shape[-1])  # (N, C)
        y, mean, rstd = kernels().layer_norm_forward(x2, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)  # what PyTorch's layer_norm keeps: the input, mean and rstd
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        gy2 = gy.to(torch.bfloat16).contiguous().view(-1, x.shape[-1])
        gx = kernels().layer_norm_backward(gy2, x.view(-1, x.shape[-1]), weight, mean, rstd)
        return gx.view(x.shape), None, None, None


def layer_norm_bf16(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """bf16(F.layer_norm(x, (C,), weight, bias, eps)) computed in fp32 (``layer_norm_fits``); (..., C) -> (..., C)."""
    return _LayerNormBf16.apply(x, weight, bias, float(eps))


def add_fits(x: Tensor, branch: Tensor) -> bool:
    """Whether the fused residual add takes a branch (with the norm's own ``fits`` / ``layer_norm_fits`` on x): bf16,
    contiguous, on the CPU, of x's shape."""
    return branch.dtype == torch.bfloat16 and branch.device.type == "cpu" and branch.is_contiguous() and \
        branch.shape == x.shape


class _AddNormBf16(torch.autograd.Function):
    """(x + branch, norm(x + branch)): the stream fp32, the branch and the norm's output bf16; the norm a LayerNorm
    (weight and bias, either None) or an RMSNorm (bias None, layer_norm False)."""

    @staticmethod
    def forward(ctx, x: Tensor, branch: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                layer_norm: bool) -> tuple[Tensor, Tensor]:
        C = x.shape[-1]
        xo, y, *stats = kernels().add_forward(x.view(-1, C), branch.view(-1, C), weight, bias, eps, layer_norm)
        xo = xo.view(x.shape)
        ctx.save_for_backward(xo, weight, *stats)  # what the norm alone keeps; the add keeps nothing
        ctx.set_materialize_grads(False)
        return xo, y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_sum: Tensor | None, gy: Tensor | None):
        xo, weight, *stats = ctx.saved_tensors
        C = xo.shape[-1]
        if gy is None:  # the norm's output unused: the add's gradient alone
            gx = torch.zeros_like(xo) if g_sum is None else g_sum
            return gx, gx.to(torch.bfloat16), None, None, None, None
        gres = None if g_sum is None else g_sum.to(torch.float32).contiguous().view(-1, C)
        gx, gb = kernels().add_backward(gy.to(torch.bfloat16).contiguous().view(-1, C), gres, xo.view(-1, C), weight,
                                        tuple(stats))
        return gx.view(xo.shape), gb.view(xo.shape), None, None, None, None


def add_rms_norm_bf16(x: Tensor, branch: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + branch, rms_norm_bf16(x + branch, weight, eps)) in one pass of C each way (``fits`` and ``add_fits``)."""
    return _AddNormBf16.apply(x, branch, weight, None, float(eps), False)


def add_layer_norm_bf16(x: Tensor, branch: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
                        ) -> tuple[Tensor, Tensor]:
    """(x + branch, layer_norm_bf16(x + branch, ...)) in one pass of C each way (``layer_norm_fits``, ``add_fits``)."""
    return _AddNormBf16.apply(x, branch, weight, bias, float(eps), True)

"""The adapter's thin products in fp32 on CPU, as C with 8-wide vector arithmetic: three calls a layer.

    if fits(x, A, B):                                  # fp32 x on CPU, fp32 masters, the kernels here
        k = kernels()                                  # minituner.native_lora.NativeLoRA, its fp32 library
        a, finite = k.forward_(y, x, A, B, scale)      # a = x·Aᵀ (N, r); y += scale·a·Bᵀ in place, all finite?
        grad_a, grad_A, grad_B = k.backward(g, x, a, B, scale)   # scale·g·B (N, r); (r, in), (out, r)
        k.input_update_(grad_x, grad_a, A)             # grad_x += grad_a·A in place (after the base's g·W)

The fp32 twin of ``minituner.native_lora`` (bf16, AVX512-BF16): the same three entry points and the same plan, for
the fp32 LoRA and QLoRA steps, which CPUs without bf16 units (and every CPU by default) run. A LoRA layer at rank r
adds six products with one side only r wide to the base's GEMM (forward x·Aᵀ and a·Bᵀ; backward g·B, aᵀ·g,
(g·B)ᵀ·x and (g·B)·A). Through PyTorch each is a separate BLAS call that reaches a small share of the machine's
speed on these shapes: on the bench's GPT-shaped fp32 QLoRA layers (N 1,024, in and out 512 or 2,048, r 8; AMD
EPYC with AVX2, 2 cores) one layer's six adapters took 3.6 ms forward and 9.9 ms backward as PyTorch ops
(``LoRAUpdate``, the input's two gradients added by autograd) and 2.1 and 6.1 ms as these kernels, each alone
(2026-12-04). Here each layer is three calls of C:
- ``forward_``: a = x·Aᵀ, then y = y + scale·(a·Bᵀ), 16 rows at a time (a and y's rows still in cache); rows split
  across threads.
- ``backward``: grad_a = scale·g·B, rows split; then grad_A = grad_aᵀ·x and grad_B = scale·gᵀ·a, columns split,
  32 rows at a time across the thread's columns (``cols_outer``: one column block down all N rows at a time read a
  cache line per row at the rows' stride; the six layers' backward took 7.5 ms that way and 4.5 ms in row tiles,
  the same bits, medians of 30 alternating calls, 2026-12-04).
- ``input_update_``: grad_x = grad_x + grad_a·A in place, added into the base's g·W (no (N, in) tensor of the
  adapter's own for autograd to add); rows split.
``minituner.lora_product`` runs them inside its one Function for base and adapter (``LoRAProduct``).

Sums are fp32 as BLAS's, in a fixed order of their own: along a row, eight lanes each summing every eighth product
(fused multiply-adds where the CPU has them), then the lanes added pairwise; down a column, the rows one after
another. Every value is summed in the same order whatever the number of threads (each is one thread's), so a run
repeats its bits. They are not PyTorch's bits (its BLAS sums in another order); tests/minituner/
test_native_lora_fp32.py holds them to fp64 references. Used where the library was built with AVX2 and FMA or
AVX-512 (``lora_vectorized``: GCC's vector extensions, compiled with -march=native); elsewhere LoRALinear runs its
PyTorch ops. Threads: PyTorch's OpenMP team (minikernels.build), or the calling thread in a forked child.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from minikernels.build import OPENMP_PRELUDE, KernelFamily
from minituner.native_lora import RANGES_C, NativeLoRA

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-fast-math", "-std=gnu11"]

_SOURCE = OPENMP_PRELUDE + RANGES_C + r"""
#include <stdlib.h>
#include <string.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#define LORA_FP32 1
#endif

int lora_vectorized(void) {
#ifdef LORA_FP32
    return 1;
#else
    return 0;
#endif
}

typedef float v8 __attribute__((vector_size(32)));  /* 8 lanes: an AVX2 register */
static inline v8 ld8(const float* p) { v8 v; memcpy(&v, p, sizeof v); return v; }  /* (unaligned) */
static inline void st8(float* p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 bc8(float s) { return (v8){s, s, s, s, s, s, s, s}; }
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
#define JG 4  /* columns of a (rows of A) per group: 2 rows x 4 sums, or 4 x 2 vectors of sums, in registers */

/* a[n * r + j] = scale * sum_k x[n * ldx + k] * A[j * K + k] for rows [n0, n1): two rows and JG of r at a time
   (a group short of JG repeats its first row and discards the sums), K in steps of 8 (the lanes added at the end),
   then the K % 8 left, one by one */
static void rows_dot(const float* x, int64_t ldx, const float* A, int64_t K, int64_t r, float scale, float* a,
                     int64_t n0, int64_t n1) {
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const float* x0 = x + n * ldx;
        const float* x1 = two ? x0 + ldx : x0;
        for (int64_t j0 = 0; j0 < r; j0 += JG) {
            const int64_t jn = r - j0 < JG ? r - j0 : JG;
            const float* row[JG];
            for (int j = 0; j < JG; j++) row[j] = A + (j0 + (j < jn ? j : 0)) * K;
            v8 s0[JG], s1[JG];
            for (int j = 0; j < JG; j++) s0[j] = s1[j] = bc8(0.0f);
            for (int64_t k = 0; k < K8; k += 8) {
                const v8 u0 = ld8(x0 + k), u1 = ld8(x1 + k);
                for (int j = 0; j < JG; j++) {
                    const v8 w = ld8(row[j] + k);
                    s0[j] += u0 * w;
                    s1[j] += u1 * w;
                }
            }
            for (int j = 0; j < jn; j++) {
                float t0 = hsum8(s0[j]), t1 = hsum8(s1[j]);
                for (int64_t k = K8; k < K; k++) {
                    t0 += x0[k] * row[j][k];
                    t1 += x1[k] * row[j][k];
                }
                a[n * r + j0 + j] = scale * t0;
                if (two) a[(n + 1) * r + j0 + j] = scale * t1;
            }
        }
    }
}

#ifdef __AVX512F__
#define VW 16  /* lanes of the wide vectors rows_update's row pairs use: an AVX-512 register */
typedef float vw __attribute__((vector_size(64)));
static inline vw bcw(float s) { return (vw){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#else
#define VW 8
typedef v8 vw;
static inline vw bcw(float s) { return bc8(s); }
#endif
static inline vw ldw(const float* p) { vw v; memcpy(&v, p, sizeof v); return v; }
static inline void stw(float* p, vw v) { memcpy(p, &v, sizeof v); }
/* y[0, VW) = y + scale·sums; returns z + the new values·0 (NaN where one is NaN or ±inf) */
static inline vw add_scaled(float* y, vw sums, vw scale, vw z) {
    const vw v = ldw(y) + scale * sums;
    stw(y, v);
    return z + v * bcw(0.0f);
}

/* rows_update for one row, columns [m0, M): 32 at a time, then 8, then one by one; z and *zs collect value·0 */
static void row_update(float* yn, const float* an, int64_t r, const float* Bt, int64_t M, float scale, int64_t m0,
                       v8* z, float* zs) {
    const v8 sv = bc8(scale);
    const int64_t M32 = m0 + ((M - m0) & ~(int64_t)31), M8 = m0 + ((M - m0) & ~(int64_t)7);
    for (int64_t mb = m0; mb < M32; mb += 32) {  /* 32 columns: 4 vectors of sums */
        v8 s[4] = {bc8(0.0f), bc8(0.0f), bc8(0.0f), bc8(0.0f)};
        for (int64_t j = 0; j < r; j++) {
            const v8 b = bc8(an[j]);
            const float* bt = Bt + j * M + mb;
            for (int q = 0; q < 4; q++) s[q] += b * ld8(bt + 8 * q);
        }
        for (int q = 0; q < 4; q++) {
            const v8 v = ld8(yn + mb + 8 * q) + sv * s[q];
            st8(yn + mb + 8 * q, v);
            *z += v * bc8(0.0f);
        }
    }
    for (int64_t mb = M32; mb < M8; mb += 8) {
        v8 s = bc8(0.0f);
        for (int64_t j = 0; j < r; j++) s += bc8(an[j]) * ld8(Bt + j * M + mb);
        const v8 v = ld8(yn + mb) + sv * s;
        st8(yn + mb, v);
        *z += v * bc8(0.0f);
    }
    for (int64_t m = M8; m < M; m++) {  /* the last few */
        float s = 0.0f;
        for (int64_t j = 0; j < r; j++) s += an[j] * Bt[j * M + m];
        yn[m] = yn[m] + scale * s;
        *zs += yn[m] * 0.0f;
    }
}

/* y[n * ldy + m] = y + scale * sum_j a[n * r + j] * Bt[j * M + m] for rows [n0, n1), in place (the sum over j in
   order, then scaled and added, as addmm_ with alpha does); Bt (r, M). Returns 1 when a value it wrote is NaN or
   ±inf (value·0 is NaN then; collected while the value is in a register, four sums apart so that no one chain of
   additions runs the length of a row).
   Two rows at a time, 2·VW columns a block: each vector of Bt loaded once for both rows, 4 vectors of sums; the
   columns past the last whole block, and an odd last row, one row at a time (row_update). Each value is the same
   chain of multiply-adds either way, so the bits do not depend on which path wrote it. (The GPT stack's 1,024 x
   2,048 update at r 8 took 0.34 ms against 0.80 one row and 8 lanes at a time, y not in cache, 2 threads; AMD
   EPYC with AVX-512, 2026-12-07.) */
static int rows_update(float* y, int64_t ldy, const float* a, int64_t r, const float* Bt, int64_t M, float scale,
                       int64_t n0, int64_t n1) {
    vw z0 = bcw(0.0f), z1 = bcw(0.0f), z2 = bcw(0.0f), z3 = bcw(0.0f);
    v8 z8 = bc8(0.0f);
    float zs = 0.0f;
    const vw sv = bcw(scale);
    const int64_t MB = M - M % (2 * VW);
    int64_t n = n0;
    for (; n + 1 < n1; n += 2) {
        const float *a0 = a + n * r, *a1 = a0 + r;
        float *y0 = y + n * ldy, *y1 = y0 + ldy;
        for (int64_t mb = 0; mb < MB; mb += 2 * VW) {
            vw s0 = bcw(0.0f), s1 = bcw(0.0f), s2 = bcw(0.0f), s3 = bcw(0.0f);
            for (int64_t j = 0; j < r; j++) {
                const float* bt = Bt + j * M + mb;
                const vw w0 = ldw(bt), w1 = ldw(bt + VW), b0 = bcw(a0[j]), b1 = bcw(a1[j]);
                s0 += b0 * w0;
                s1 += b0 * w1;
                s2 += b1 * w0;
                s3 += b1 * w1;
            }
            z0 = add_scaled(y0 + mb, s0, sv, z0);
            z1 = add_scaled(y0 + mb + VW, s1, sv, z1);
            z2 = add_scaled(y1 + mb, s2, sv, z2);
            z3 = add_scaled(y1 + mb + VW, s3, sv, z3);
        }
        row_update(y0, a0, r, Bt, M, scale, MB, &z8, &zs);
        row_update(y1, a1, r, Bt, M, scale, MB, &z8, &zs);
    }
    if (n < n1) row_update(y + n * ldy, a + n * r, r, Bt, M, scale, 0, &z8, &zs);
    const vw zw = (z0 + z1) + (z2 + z3);
    float zz = hsum8(z8) + zs;
    for (int i = 0; i < VW; i++) zz += zw[i];
    return zz != zz;
}

#define LORA_ROW_TILE 32  /* cols_outer: rows at a time, so a tile (32 rows of the chunk's columns) stays in L2 */

/* out[j * ldj + m * ldm] = scale * sum_n a[n * r + j] * y[n * ldy + m] for the columns of blocks [b0, b1) of 16
   (the last cut at M): the rows n in order, LORA_ROW_TILE at a time; within a tile, for each block of 16 columns and
   JG of a's r columns, 2 x JG vectors of sums in registers, carried from tile to tile in acc (r rows of the
   blocks' 16 columns each), so each sum runs over n in order as one chain.
   (One block through all N rows at a time reads one cache line per row at the rows' stride, a page every row or
   two: 4.6 ms for the six x·grad_a of a GPT-stack layer set against 1.1 ms to read every g and x once.) */
static void cols_outer(const float* a, int64_t r, const float* y, int64_t ldy, int64_t N, int64_t M, float scale,
                       float* out, int64_t ldj, int64_t ldm, int64_t b0, int64_t b1, float* acc) {
    const int64_t m0 = 16 * b0, m1 = 16 * b1 < M ? 16 * b1 : M, w = 16 * (b1 - b0);  /* acc: r x w */
    if (N == 0) memset(acc, 0, (size_t)(r * w) * sizeof(float));
    for (int64_t n0 = 0; n0 < N; n0 += LORA_ROW_TILE) {
        const int64_t n1 = n0 + LORA_ROW_TILE < N ? n0 + LORA_ROW_TILE : N;
        for (int64_t mb = m0; mb < m1; mb += 16) {
            const int64_t mn = m1 - mb < 16 ? m1 - mb : 16;
            for (int64_t j0 = 0; j0 < r; j0 += JG) {
                const int64_t jn = r - j0 < JG ? r - j0 : JG;
                v8 s[JG][2];
                for (int j = 0; j < JG; j++) {
                    const float* c = acc + (j0 + (j < jn ? j : 0)) * w + (mb - m0);
                    s[j][0] = n0 ? ld8(c) : bc8(0.0f);
                    s[j][1] = n0 ? ld8(c + 8) : bc8(0.0f);
                }
                for (int64_t n = n0; n < n1; n++) {
                    v8 y0, y1;
                    if (j0 == 0) __builtin_prefetch(y + n * ldy + mb + 16);  /* the next block, this row */
                    if (mn == 16) {
                        y0 = ld8(y + n * ldy + mb);
                        y1 = ld8(y + n * ldy + mb + 8);
                    } else {  /* the last columns, through a zero-padded copy of the row's */
                        float t[16] = {0};
                        memcpy(t, y + n * ldy + mb, (size_t)mn * sizeof(float));
                        y0 = ld8(t);
                        y1 = ld8(t + 8);
                    }
                    const float* an = a + n * r + j0;
                    for (int j = 0; j < JG; j++) {
                        const v8 b = bc8(an[j < jn ? j : 0]);
                        s[j][0] += b * y0;
                        s[j][1] += b * y1;
                    }
                }
                for (int j = 0; j < jn; j++) {
                    float* c = acc + (j0 + j) * w + (mb - m0);
                    st8(c, s[j][0]);
                    st8(c + 8, s[j][1]);
                }
            }
        }
    }
    for (int64_t j = 0; j < r; j++)  /* scaled once, at the end, as before */
        for (int64_t m = m0; m < m1; m++) out[j * ldj + m * ldm] = scale * acc[j * w + (m - m0)];
}

#define LORA_ROW_BLOCK 16  /* rows_dot then rows_update on 16 rows at a time: a and y's rows still in L1 */

static void transpose(const float* B, int64_t M, int64_t r, float* Bt) {  /* B (M, r) -> Bt (r, M) */
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < r; j++) Bt[j * M + m] = B[m * r + j];
}

/* forward: a = x·Aᵀ (N, r), then y += scale·a·Bᵀ in place; A (r, K), B (M, r). *nonfinite = 1 when a value of y it
   wrote is NaN or ±inf, else 0 */
int lora_forward(const float* x, int64_t ldx, const float* A, const float* B, int64_t N, int64_t K, int64_t M,
                 int64_t r, float scale, float* a, float* y, int64_t ldy, int* nonfinite, int64_t chunks,
                 int threads) {
    *nonfinite = 0;
    float* Bt = malloc((size_t)(r * M) * sizeof(float));
    if (!Bt) return 1;
    transpose(B, M, r, Bt);
    LORA_RANGES(N, u0, u1, {
        for (int64_t n = u0; n < u1; n += LORA_ROW_BLOCK) {
            const int64_t e = n + LORA_ROW_BLOCK < u1 ? n + LORA_ROW_BLOCK : u1;
            rows_dot(x, ldx, A, K, r, 1.0f, a, n, e);
            if (rows_update(y, ldy, a, r, Bt, M, scale, n, e)) __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
        }
    });
    free(Bt);
    return 0;
}

/* backward, from g (N, M), x (N, K) and a (N, r): grad_a = scale·g·B (N, r), rows split across threads; then,
   columns split, grad_A = grad_aᵀ·x (r, K) and grad_B = scale·(aᵀ·g)ᵀ (M, r) (either may be NULL) */
int lora_backward(const float* g, int64_t ldg, const float* x, int64_t ldx, const float* a, const float* B,
                  int64_t N, int64_t K, int64_t M, int64_t r, float scale, float* grad_a, float* grad_A,
                  float* grad_B, int64_t chunks, int threads) {
    if (grad_A && !grad_a) return 2;  /* grad_A is summed from grad_a */
    if (grad_a) {
        float* Bt = malloc((size_t)(r * M) * sizeof(float));
        if (!Bt) return 1;
        transpose(B, M, r, Bt);
        LORA_RANGES(N, u0, u1, rows_dot(g, ldg, Bt, M, r, scale, grad_a, u0, u1));
        free(Bt);
    }
    const int64_t kb = grad_A ? (K + 15) / 16 : 0, mb = grad_B ? (M + 15) / 16 : 0;
    const int64_t blocks = kb + mb;
    if (chunks > blocks) chunks = blocks;
    /* the running sums, each chunk its own 16·r per block (allocated here, on the calling thread: a malloc on one
       of OpenMP's threads would give it a heap arena of its own, resident from then on) */
    float* acc = malloc((size_t)(16 * r * (blocks > 0 ? blocks : 1)) * sizeof(float));
    if (!acc) return 1;
    LORA_RANGES(blocks, u0, u1, {
        if (u0 < kb) cols_outer(grad_a, r, x, ldx, N, K, 1.0f, grad_A, K, 1, u0, u1 < kb ? u1 : kb, acc + 16 * r * u0);
        if (u1 > kb) {
            const int64_t v0 = u0 > kb ? u0 : kb;
            cols_outer(a, r, g, ldg, N, M, scale, grad_B, 1, r, v0 - kb, u1 - kb, acc + 16 * r * v0);
        }
    });
    free(acc);
    return 0;
}

/* grad_x += grad_a·A in place (N, K); A (r, K) the master */
int lora_input_update(float* grad_x, int64_t ldx, const float* grad_a, const float* A, int64_t N, int64_t K,
                      int64_t r, int64_t chunks, int threads) {
    LORA_RANGES(N, u0, u1, (void)rows_update(grad_x, ldx, grad_a, r, A, K, 1.0f, u0, u1));
    return 0;
}
"""

_FAMILY = KernelFamily("lora_fp32", _SOURCE, CFLAGS, "minituner's fp32 LoRA kernels",
                       partial(NativeLoRA, dtype=torch.float32), vectorized="lora_vectorized", parallel=True)


def kernels() -> NativeLoRA | None:
    """The kernels, built on first use; None where they are off (MINIQUANT_NATIVE=0), cannot be built, or the CPU
    lacks AVX2 with FMA (``lora_vectorized``)."""
    return _FAMILY.kernels()


def _fp32_cpu(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2


def fits(x: Tensor, A: Tensor, B: Tensor) -> bool:
    """Whether these kernels run the adapter A (r, in), B (out, r) on x (N, in): x fp32 on CPU with contiguous rows,
    A and B contiguous fp32 CPU masters of matching shapes, the kernels built here. (The output y and the gradients
    g and grad_x that go with x are fp32 with contiguous rows as LoRAProduct makes them.)"""
    return (_fp32_cpu(x) and x.stride(1) == 1 and _fp32_cpu(A) and A.is_contiguous() and _fp32_cpu(B)
            and B.is_contiguous() and A.shape[0] >= 1 and A.shape[1] == x.shape[1] and B.shape[1] == A.shape[0]
            and kernels() is not None)

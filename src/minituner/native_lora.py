"""The adapter's thin products in bf16 on CPU, as C with AVX-512 bf16 dot products (vdpbf16ps): three calls a layer.

    if fits(x, A, B):                                  # bf16 x on CPU, fp32 masters, an even rank, kernels here
        k = kernels()
        a, finite = k.forward_(y, x, A, B, scale)      # a = x·Aᵀ (N, r); y += scale·a·Bᵀ in place, all finite?
        grad_a, grad_A, grad_B = k.backward(g, x, a, B, scale)   # scale·g·B (N, r); fp32 (r, in), (out, r)
        k.input_update_(grad_x, grad_a, A)             # grad_x += grad_a·A in place (after the base's g·W)

A LoRA layer at rank r adds six products with one side only r wide to the base's GEMM (forward x·Aᵀ and a·Bᵀ;
backward g·B, aᵀ·g, (g·B)ᵀ·x and (g·B)·A). Each reads or writes a whole (N, in) or (N, out) tensor for 2·r
multiply-adds per value, so each should cost about one pass over that tensor. Through PyTorch each is a oneDNN
bf16 GEMM call plus the casts and scalings around them, separate ops: on the bench's GPT-shaped bf16 QLoRA step
(benchmarks/bench_bf16.py: N 1,024, in and out 512 or 2,048, r 8, 48 layers; AMD EPYC with AVX512-BF16, 2 cores)
the step's 285 thin products took 52 ms of a 270 ms step, 120-140 µs each for the (1024, 512) ones, against
37-43 µs each timed alone; a (1024, 512) x·Aᵀ right after the base's GEMM took 130 µs in oneDNN and 47 µs as this
file's loop (2026-12-03). Here each layer is three calls of C, each one pass over its wide operands:
- ``forward_``: a = bf16(x·Aᵀ), then y = bf16(y + scale·a·Bᵀ), 16 rows at a time (a and y's rows still in cache);
  rows split across threads.
- ``backward``: grad_a = bf16(scale·g·B), rows split; then grad_A = grad_aᵀ·x and grad_B = scale·gᵀ·a, summed and
  handed over in fp32 (the masters' dtype: no bf16 rounding on the way), columns split, so every value is summed
  in one order whatever the number of threads; 32 rows at a time across the thread's columns (``lora_cols_outer``:
  one column block down all N rows at a time read a cache line per row at the rows' stride; on an Intel Xeon with
  AMX, 2 threads, one GPT-stack layer's six adapters took 3.79 ms backward that way and 3.28 ms in row tiles, a
  Llama-3.2-1B layer's seven (N 512, r 16) 32.1 and 15.7 ms, the same bits, medians of 30 alternating calls,
  2026-12-04). Where the library is built for a CPU with AMX these two sums run in fp32 FMAs instead of vdpbf16ps
  (``use_fma``), one product at a time in the instruction's order under DAZ and FTZ: the same bits (tested), as
  the product of two bf16 values is exact in fp32. On an Intel Xeon with AMX (model 207) vdpbf16ps issued once
  every 2 cycles, half the rate of two FMA ports in multiply-adds; there (2 threads, alone) a (1,024, 512 -> 512)
  backward took 0.13 against 0.17 ms, (1,024, 512 -> 2,048) 0.37 against 0.47 ms, and the GPT-shaped bf16 QLoRA
  step 185.27 against 188.19 and 190.62 against 195.62 ms (medians of 24 and 30 paced turns, 2026-12-06).
- ``input_update_``: grad_x = bf16(grad_x + grad_a·A) in place, rounded once as ``addmm_`` rounds; rows split.
  Where the sums above run in FMAs, so do this update's and the forward's update of y (4 rows sharing each load
  of the adapter's values, the sums under DAZ and FTZ, the update under the caller's MXCSR): the same bits. Alone
  (the same machine, 2 threads): forward_ at (1,024, 512 -> 512) 0.125 against 0.15 ms, at Llama-3.2-1B's
  (512, 2,048 -> 8,192, r 16) 1.16-1.23 against 1.47-1.48 ms; input_update_ at (512, 8,192 -> 2,048) 1.08-1.18
  against 1.29-1.42 ms. Much of these calls is the pass over y or grad_x itself.
Each call rounds the fp32 masters it reads to bf16 itself (as ``.to(torch.bfloat16)`` rounds them), so the layer
keeps no bf16 copies (minituner.planner counts none: ``bf16_compute_lora``). On the bench's step this took the
step from 307.4 to 275.6 ms (medians of 24 steps, the two alternating in one process).

Where the CPU has AMX (``amx_bf16``: Intel's tile units) and Linux grants this process its tiles, the two
products down a wide operand's rows (the forward's x·Aᵀ and the backward's g·B, where in or out is a multiple of
32) run there instead: 16 rows of x by 32 of its values against the adapter's pairs, one tile instruction, the
sums carried in a tile (``NativeLoRA.use_amx``). Each row's sums depend on its own row only, in one order over k,
so the bits do not depend on the threads' split; they are not vdpbf16ps's (another order). On an Intel Xeon with
AMX (2 threads, 2026-12-05; alone, medians of 30): forward (N 1,024, 2,048 -> 512, r 8) 162 µs against 263,
backward (1,024, 512 -> 2,048) 416 against 511; at Llama-3.2-1B's shapes (N 512, r 16) the forward of down_proj
(8,192 -> 2,048) 460 against 967 µs, the backward of gate_proj (2,048 -> 8,192) 1,226 against 2,148. The
Llama-3.2-1B-shaped bf16 QLoRA step (6 layers) 1,004 against 1,026 ms (medians of 10 paced turns); the GPT-shaped
one 168 against 166 ms (30 turns, within its noise). The rest (y's update, the masters' gradients, the input's
update) keeps vdpbf16ps's sums (run as FMAs where the library is built for such a CPU, above).

Sums are fp32, in the instruction's order: vdpbf16ps adds two bf16 products per lane and, as oneDNN's bf16 GEMM
does on these CPUs (the same instruction), treats denormal inputs as zero and flushes denormal results. Roundings
to bf16 are PyTorch's (nearest even, NaN as 0x7FC0). The results are not oneDNN's bits (its sums run in another
order); tests/minituner/test_native_lora.py holds them to fp32 references of the same bf16 operands.

Used by ``minituner.lora_product`` where ``fits``: the library built with AVX512-BF16 (``lora_vectorized``), x with
contiguous rows, contiguous fp32 masters, an even rank (the kernels pair r). Elsewhere LoRAProduct runs PyTorch's
products. Threads: PyTorch's OpenMP team (minikernels.build), or the calling thread in a forked child.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.amx_tiles import AMX_TILES_C
from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import CPU_COUNT, OPENMP_PRELUDE, KernelFamily, ThreadSplit

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
MIN_VALUES_PER_THREAD = 1 << 17  # a smaller wide operand stays on the calling thread (handing over costs ~10 µs)
CHUNK_VALUES = 1 << 18  # threads take rows (columns) in chunks of about this many values
MAX_RANK = 1024  # the C's MAX_RANK: larger ranks run as PyTorch ops

RANGES_C = r"""
/* CALL for the `chunks` ranges [u0, u1) of [0, n) on `threads` of OpenMP's team (dynamic: a thread that waits for a
   core leaves its share to the others), or for [0, n) on this thread (threads 1: also a forked child's, where
   libgomp must not be entered) */
#define LORA_RANGES(n, u0, u1, CALL) do { \
    if (threads > 1) { \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)") \
        for (int64_t c_ = 0; c_ < chunks; c_++) { \
            const int64_t u0 = (n) * c_ / chunks, u1 = (n) * (c_ + 1) / chunks; \
            CALL; \
        } \
    } else { \
        const int64_t u0 = 0, u1 = (n); \
        CALL; \
    } \
} while (0)
"""  # (also minituner.native_lora_fp32's)

_SOURCE = OPENMP_PRELUDE + RANGES_C + BF16_EXP_C + AMX_TILES_C + r"""
#include <stdlib.h>
#include <string.h>
#define MAX_RANK 1024  /* ranks above this run as PyTorch ops (fits; MAX_RANK there) */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LORA_BF16 1
#include <immintrin.h>
#endif

int lora_vectorized(void) {
#ifdef LORA_BF16
    return 1;
#else
    return 0;
#endif
}

#ifdef LORA_BF16
/* bf16 <-> fp32: BF16_EXP_C's bf16_from_f32, load16 and store16 (nearest even, NaN -> 0x7FC0, denormals kept) */
static inline __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (((__mmask32)1 << n) - 1); }
static inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline __m512bh bh(__m512i v) { return (__m512bh)v; }
#endif

/* a[n * r + j] = bf16(scale * sum_k x[n * ldx + k] * A[j * K + k]) for rows [n0, n1): two rows at a time, r in
   groups of 8 (a group short of 8 repeats its first row and discards the sums), K in steps of 32 (masked tail) */
static void lora_rows_dot(const uint16_t* x, int64_t ldx, const uint16_t* A, int64_t K, int64_t r, float scale,
                   uint16_t* a, int64_t n0, int64_t n1) {
#ifdef LORA_BF16
    for (int64_t n = n0; n < n1; n += 2) {
        const int two = n + 1 < n1;
        const uint16_t* x0 = x + n * ldx;
        const uint16_t* x1 = two ? x0 + ldx : x0;
        for (int64_t j0 = 0; j0 < r; j0 += 8) {
            const int64_t jn = r - j0 < 8 ? r - j0 : 8;
            const uint16_t* row[8];
            for (int j = 0; j < 8; j++) row[j] = A + (j0 + (j < jn ? j : 0)) * K;
            __m512 s0[8], s1[8];
            for (int j = 0; j < 8; j++) s0[j] = s1[j] = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                const __m512i v0 = _mm512_loadu_si512(x0 + k), v1 = _mm512_loadu_si512(x1 + k);
                for (int j = 0; j < 8; j++) {
                    const __m512i w = _mm512_loadu_si512(row[j] + k);
                    s0[j] = _mm512_dpbf16_ps(s0[j], bh(v0), bh(w));
                    s1[j] = _mm512_dpbf16_ps(s1[j], bh(v1), bh(w));
                }
            }
            if (k < K) {  /* the last K % 32 */
                const __mmask32 m = mask32(K - k);
                const __m512i v0 = _mm512_maskz_loadu_epi16(m, x0 + k), v1 = _mm512_maskz_loadu_epi16(m, x1 + k);
                for (int j = 0; j < 8; j++) {
                    const __m512i w = _mm512_maskz_loadu_epi16(m, row[j] + k);
                    s0[j] = _mm512_dpbf16_ps(s0[j], bh(v0), bh(w));
                    s1[j] = _mm512_dpbf16_ps(s1[j], bh(v1), bh(w));
                }
            }
            for (int j = 0; j < jn; j++) {
                a[n * r + j0 + j] = bf16_from_f32(scale * _mm512_reduce_add_ps(s0[j]));
                if (two) a[(n + 1) * r + j0 + j] = bf16_from_f32(scale * _mm512_reduce_add_ps(s1[j]));
            }
        }
    }
#endif
}

#ifdef MK_AMX
#define LORA_AMX 1
#endif

/* AMX (Intel's tile units, amx_bf16): where the CPU has them and Linux lets this process use them, rows_dot's
   products run there (lora_rows_dot_amx), else on vdpbf16ps as above. lora_use_amx(1) asks Linux once (the
   permission is the process's, for all its threads) and returns whether they run; lora_use_amx(0) turns them off */
static int lora_amx = 0;
int lora_use_amx(int want) {
#ifdef LORA_AMX
    lora_amx = want && mk_amx_permit();
#else
    (void)want;
#endif
    return lora_amx;
}

#ifdef LORA_BF16
/* W (r, K) fp32, rounded to bf16, as the pairs a tile of AMX reads: Wp[p * r + j] = (W[j, 2p], W[j, 2p + 1]) for
   p < K / 2 (K even); with transposed = 1, W is given as its transpose (K, r) (B of an (out, r) adapter) */
static void amx_pairs(const float* W, int64_t K, int64_t r, int transposed, uint32_t* Wp) {
    for (int64_t p = 0; p < K / 2; p++)
        for (int64_t j = 0; j < r; j++) {
            const float lo = transposed ? W[2 * p * r + j] : W[j * K + 2 * p];
            const float hi = transposed ? W[(2 * p + 1) * r + j] : W[j * K + 2 * p + 1];
            Wp[p * r + j] = (uint32_t)bf16_from_f32(lo) | (uint32_t)bf16_from_f32(hi) << 16;
        }
}
#endif

#ifdef LORA_AMX
/* rows_dot on AMX: a[n * r + j] = bf16(scale * sum_k x[n * ldx + k] * W[j, k]) for rows [n0, n1), W as amx_pairs
   (Wp), K a multiple of 32. Tiles: 0 the sums (m rows x 16 columns of j, fp32), 1 x's rows (m x 32 values of k),
   2 W's pairs (16 pairs of k x 16 j). Each row's sums depend on its own x row only, in the tile's order over k:
   the same bits whatever the rows around it or the threads' split */
static void lora_rows_dot_amx(const uint16_t* x, int64_t ldx, const uint32_t* Wp, int64_t K, int64_t r, float scale,
                              uint16_t* a, int64_t n0, int64_t n1) {
    float c[16 * 16];
    int loaded_m = -1, loaded_jn = -1;
    for (int64_t n = n0; n < n1; n += 16) {
        const int m = n1 - n < 16 ? (int)(n1 - n) : 16;
        for (int64_t j0 = 0; j0 < r; j0 += 16) {
            const int jn = r - j0 < 16 ? (int)(r - j0) : 16;
            if (m != loaded_m || jn != loaded_jn) {
                mk_tile_config cfg;
                memset(&cfg, 0, sizeof cfg);
                cfg.palette = 1;
                cfg.rows[0] = (uint8_t)m, cfg.colsb[0] = (uint16_t)(4 * jn);
                cfg.rows[1] = (uint8_t)m, cfg.colsb[1] = 64;
                cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(4 * jn);
                _tile_loadconfig(&cfg);
                loaded_m = m, loaded_jn = jn;
            }
            _tile_zero(0);
            for (int64_t k = 0; k < K; k += 32) {
                _tile_loadd(1, x + n * ldx + k, 2 * ldx);
                _tile_loadd(2, Wp + k / 2 * r + j0, 4 * r);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, c, 64);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < jn; j++) a[(n + i) * r + j0 + j] = bf16_from_f32(scale * c[i * 16 + j]);
        }
    }
    _tile_release();
}
#endif

#ifdef LORA_BF16
/* rows_dot where it runs: on AMX (Wp given: lora_amx on and K a multiple of 32), else on vdpbf16ps (Wb, W in bf16) */
static void lora_rows_dot_any(const uint16_t* x, int64_t ldx, const uint16_t* Wb, const uint32_t* Wp, int64_t K,
                              int64_t r, float scale, uint16_t* a, int64_t n0, int64_t n1) {
#ifdef LORA_AMX
    if (Wp) { lora_rows_dot_amx(x, ldx, Wp, K, r, scale, a, n0, n1); return; }
#endif
    (void)Wp;
    lora_rows_dot(x, ldx, Wb, K, r, scale, a, n0, n1);
}
#endif

/* the pairs lora_cols_outer reads: for each group of 8 of a's r columns and each pair of rows n, n + 1, the 8 words
   (a[n, j], a[n + 1, j]) (a zero row after an odd N; a group short of 8 repeats its first j, whose sums are
   discarded); (r + 7) / 8 * (N + 1) / 2 * 8 words. With fma (lora_cols_outer_fma's), 16 floats a pair instead:
   a[n + 1, j] for the 8 j, then a[n, j] (pair_floats of them) */
static int64_t pair_words(int64_t N, int64_t r) { return (r + 7) / 8 * ((N + 1) / 2) * 8; }
static int64_t pair_floats(int64_t N, int64_t r) { return 2 * pair_words(N, r); }
static void pack_pairs(const uint16_t* a, int64_t N, int64_t r, int fma, void* pairs) {
    for (int64_t j0 = 0, g = 0; j0 < r; j0 += 8, g++) {
        const int64_t jn = r - j0 < 8 ? r - j0 : 8;
        for (int64_t n = 0; n < N; n += 2)
            for (int j = 0; j < 8; j++) {
                const int64_t c = j0 + (j < jn ? j : 0), pair = g * ((N + 1) / 2) + n / 2;
                const uint16_t next = n + 1 < N ? a[(n + 1) * r + c] : 0;
                if (fma) {
                    ((float*)pairs)[pair * 16 + j] = f32_from_bf16(next);
                    ((float*)pairs)[pair * 16 + 8 + j] = f32_from_bf16(a[n * r + c]);
                } else {
                    ((uint32_t*)pairs)[pair * 8 + j] = (uint32_t)a[n * r + c] | (uint32_t)next << 16;
                }
            }
    }
}

#define LORA_PAIR_TILE 16  /* lora_cols_outer: pairs of rows at a time (a tile: 32 rows of the chunk's columns) */

/* out[j * ldj + m * ldm] = scale * sum_n a[n, j] * y[n * ldy + m] (fp32) for the columns of blocks [b0, b1) of 32
   (the last cut at M): the rows in pairs (each lane of vdpbf16ps sums rows n and n + 1 of one column, pairs from
   pack_pairs), LORA_PAIR_TILE pairs at a time; within a tile, for each block of 32 columns and 8 of a's r columns,
   8 x 2 vectors of sums in registers, carried from tile to tile in acc ((r + 7) / 8 * 8 rows of the blocks' 32
   columns each), so each sum runs over the pairs in order as one chain.
   (One block down all N rows at a time read a cache line per row at the rows' stride, as in
   minituner.native_lora_fp32's cols_outer.)
   With fma (lora_cols_outer_fma), the same sums in fp32 FMAs, one product at a time in vdpbf16ps's order (row
   n + 1's, then row n's; the product of two bf16 values is exact in fp32, so an FMA rounds each addition as
   vdpbf16ps does), under MXCSR's DAZ and FTZ as vdpbf16ps treats denormals: the same bits. On an Intel Xeon with
   AMX (model 207) vdpbf16ps issued once every 2 cycles (0.71 ns against 0.17 for a 512-bit FMA), so its 32
   products an instruction come at half of two FMA ports' 2 x 16. Elsewhere (AMD's EPYC: not measured here) the
   library keeps vdpbf16ps (lora_use_fma). With fma the pairs are floats (pack_pairs), and y's 32 columns of a
   block split by parity, as a bf16 value's bits are an fp32's top half (the even ones by a shift, the odd ones by
   a mask): acc keeps each block's 16 even columns, then its 16 odd ones (outer_column). */
static inline int64_t outer_column(int64_t c) { return c / 32 * 32 + (c % 2 ? 16 : 0) + c % 32 / 2; }
static inline __attribute__((always_inline)) void lora_cols_outer_any(
        const int fma, const void* pairs, int64_t r, const uint16_t* y, int64_t ldy, int64_t N, int64_t M,
        float scale, float* out, int64_t ldj, int64_t ldm, int64_t b0, int64_t b1, float* acc) {
#ifdef LORA_BF16
    const unsigned csr = _mm_getcsr();
    if (fma) _mm_setcsr(csr | 0x8040);  /* FTZ (bit 15) and DAZ (bit 6), this thread's, until the sums are done */
    const int64_t m0 = 32 * b0, m1 = 32 * b1 < M ? 32 * b1 : M, w = 32 * (b1 - b0), P = (N + 1) / 2;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    if (P == 0) memset(acc, 0, (size_t)((r + 7) / 8 * 8 * w) * sizeof(float));
    for (int64_t p0 = 0; p0 < P; p0 += LORA_PAIR_TILE) {
        const int64_t p1 = p0 + LORA_PAIR_TILE < P ? p0 + LORA_PAIR_TILE : P;
        for (int64_t mb = m0; mb < m1; mb += 32) {
            const int64_t mn = m1 - mb < 32 ? m1 - mb : 32;
            const __mmask32 m = mask32(mn);
            for (int64_t j0 = 0, g = 0; j0 < r; j0 += 8, g++) {
                float* c = acc + j0 * w + (mb - m0);
                __m512 s[8][2];  /* with fma: [j][0] the block's even columns, [j][1] its odd ones */
                for (int j = 0; j < 8; j++) {
                    s[j][0] = p0 ? _mm512_loadu_ps(c + j * w) : _mm512_setzero_ps();
                    s[j][1] = p0 ? _mm512_loadu_ps(c + j * w + 16) : _mm512_setzero_ps();
                }
                for (int64_t p = p0; p < p1; p++) {
                    const int64_t n = 2 * p;
                    const int two = n + 1 < N;
                    __m512i y0, y1 = _mm512_setzero_si512();
                    if (j0 == 0) {  /* the next block, these rows */
                        _mm_prefetch((const char*)(y + n * ldy + mb + 32), _MM_HINT_T0);
                        if (two) _mm_prefetch((const char*)(y + (n + 1) * ldy + mb + 32), _MM_HINT_T0);
                    }
                    if (mn == 32) {  /* (a masked load costs twice a plain one here) */
                        y0 = _mm512_loadu_si512(y + n * ldy + mb);
                        if (two) y1 = _mm512_loadu_si512(y + (n + 1) * ldy + mb);
                    } else {
                        y0 = _mm512_maskz_loadu_epi16(m, y + n * ldy + mb);
                        if (two) y1 = _mm512_maskz_loadu_epi16(m, y + (n + 1) * ldy + mb);
                    }
                    if (fma) {
                        const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(y0, 16));
                        const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(y0, top));
                        const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(y1, 16));
                        const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(y1, top));
                        const float* pn = (const float*)pairs + (g * P + p) * 16;
                        for (int j = 0; j < 8; j++) {  /* row n + 1 first, as vdpbf16ps adds its pair */
                            const __m512 b = _mm512_set1_ps(pn[j]);
                            s[j][0] = _mm512_fmadd_ps(e1, b, s[j][0]);
                            s[j][1] = _mm512_fmadd_ps(o1, b, s[j][1]);
                        }
                        for (int j = 0; j < 8; j++) {
                            const __m512 b = _mm512_set1_ps(pn[8 + j]);
                            s[j][0] = _mm512_fmadd_ps(e0, b, s[j][0]);
                            s[j][1] = _mm512_fmadd_ps(o0, b, s[j][1]);
                        }
                    } else {
                        const __m512i q0 = _mm512_permutex2var_epi16(y0, lo, y1);
                        const __m512i q1 = _mm512_permutex2var_epi16(y0, hi, y1);
                        const uint32_t* pn = (const uint32_t*)pairs + (g * P + p) * 8;
                        for (int j = 0; j < 8; j++) {
                            const __m512i b = _mm512_set1_epi32((int32_t)pn[j]);
                            s[j][0] = _mm512_dpbf16_ps(s[j][0], bh(q0), bh(b));
                            s[j][1] = _mm512_dpbf16_ps(s[j][1], bh(q1), bh(b));
                        }
                    }
                }
                for (int j = 0; j < 8; j++) {  /* (a group short of 8: its repeats land in acc's padding rows) */
                    _mm512_storeu_ps(c + j * w, s[j][0]);
                    _mm512_storeu_ps(c + j * w + 16, s[j][1]);
                }
            }
        }
    }
    if (fma) _mm_setcsr(csr);
    for (int64_t j = 0; j < r; j++)  /* scaled once, at the end */
        for (int64_t mc = m0; mc < m1; mc++)
            out[j * ldj + mc * ldm] = scale * acc[j * w + (fma ? outer_column(mc - m0) : mc - m0)];
#endif
}
static void lora_cols_outer(const uint32_t* pairs, int64_t r, const uint16_t* y, int64_t ldy, int64_t N, int64_t M,
                            float scale, float* out, int64_t ldj, int64_t ldm, int64_t b0, int64_t b1, float* acc) {
    lora_cols_outer_any(0, pairs, r, y, ldy, N, M, scale, out, ldj, ldm, b0, b1, acc);
}
static void lora_cols_outer_fma(const float* pairs, int64_t r, const uint16_t* y, int64_t ldy, int64_t N, int64_t M,
                                float scale, float* out, int64_t ldj, int64_t ldm, int64_t b0, int64_t b1, float* acc) {
    lora_cols_outer_any(1, pairs, r, y, ldy, N, M, scale, out, ldj, ldm, b0, b1, acc);
}

/* whether the sums of lora_backward's masters' gradients (lora_cols_outer_fma) and of y's update in lora_forward
   and lora_input_update (lora_rows_update_fma) run in FMAs rather than in vdpbf16ps: the same bits, the faster
   where the library is built for a CPU with AMX (measured on one: vdpbf16ps at half rate); lora_use_fma(0) or
   (1) sets it (tests run both), lora_use_fma(-1) leaves it; each returns it */
#ifdef __AMX_BF16__
static int lora_fma = 1;
#else
static int lora_fma = 0;
#endif
int lora_use_fma(int want) {
    if (want >= 0) lora_fma = want != 0;
    return lora_fma;
}

#ifdef LORA_BF16
/* lanes of 16 bf16 values that are NaN or ±inf (all exponent bits set) */
static inline __mmask16 nonfinite16(const uint16_t* v) {
    const __m256i e = _mm256_set1_epi16(0x7F80);
    return _mm256_cmpeq_epi16_mask(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)v), e), e);
}
/* y[0, n) = bf16(y + sums·scale) for n <= 16 values (fewer through a zero-padded copy: store16 writes 16); returns
   the lanes whose new value is NaN or ±inf. y's update in lora_rows_update and lora_rows_update_fma */
static inline __mmask16 add_scaled16(uint16_t* y, int64_t n, __m512 sums, __m512 scale) {
    if (n == 16) {
        store16(y, _mm512_add_ps(load16(y), _mm512_mul_ps(sums, scale)));
        return nonfinite16(y);
    }
    uint16_t t[16] = {0};
    memcpy(t, y, (size_t)n * sizeof(uint16_t));
    store16(t, _mm512_add_ps(load16(t), _mm512_mul_ps(sums, scale)));
    memcpy(y, t, (size_t)n * sizeof(uint16_t));
    return nonfinite16(t) & mask16(n);
}
#endif

/* y[n * ldy + m] = bf16(y + scale * sum_j a[n * r + j] * B[m, j]) for rows [n0, n1), in place; r even; P holds B
   as pairs, P[i * M + m] = (B[m, 2i], B[m, 2i + 1]) in one 32-bit word: each lane of vdpbf16ps sums two j.
   Returns 1 when a value it wrote is NaN or ±inf, else 0 (each checked in L1 right after its store) */
static int lora_rows_update(uint16_t* y, int64_t ldy, const uint16_t* a, int64_t r, const uint32_t* P, int64_t M,
                      float scale, int64_t n0, int64_t n1) {
    int bad = 0;
#ifdef LORA_BF16
    __mmask16 seen = 0;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t n = n0; n < n1; n++) {
        uint32_t an[MAX_RANK / 2];  /* a[n, 2i] and a[n, 2i + 1] as one word (memcpy: no uint32_t view of bf16) */
        memcpy(an, a + n * r, (size_t)r * sizeof(uint16_t));
        uint16_t* yn = y + n * ldy;
        int64_t mb = 0;
        for (; mb + 64 <= M; mb += 64) {  /* 64 columns: 4 vectors of sums */
            __m512 s[4];
            for (int q = 0; q < 4; q++) s[q] = _mm512_setzero_ps();
            for (int64_t i = 0; i < r / 2; i++) {
                const __m512i b = _mm512_set1_epi32((int32_t)an[i]);
                for (int q = 0; q < 4; q++)
                    s[q] = _mm512_dpbf16_ps(s[q], bh(_mm512_loadu_si512(P + i * M + mb + 16 * q)), bh(b));
            }
            for (int q = 0; q < 4; q++) seen |= add_scaled16(yn + mb + 16 * q, 16, s[q], sv);
        }
        for (; mb < M; mb += 16) {  /* the rest, 16 columns at a time (masked) */
            const __mmask16 m = mask16(M - mb);
            __m512 s = _mm512_setzero_ps();
            for (int64_t i = 0; i < r / 2; i++)
                s = _mm512_dpbf16_ps(s, bh(_mm512_maskz_loadu_epi32(m, P + i * M + mb)), bh(_mm512_set1_epi32((int32_t)an[i])));
            seen |= add_scaled16(yn + mb, M - mb < 16 ? M - mb : 16, s, sv);
        }
    }
    bad = seen != 0;
#endif
    return bad;
}

/* lora_rows_update with its sums in fp32 FMAs (lora_use_fma), in vdpbf16ps's order (for each pair i: j = 2i + 1,
   then 2i) under DAZ and FTZ, as lora_cols_outer_fma: the same sums, so the same bits. W: the adapter's values
   (r, M) fp32, each rounded to bf16 (col_floats, row_floats). LORA_FMA_ROWS rows share each load of W's vectors
   (vdpbf16ps's rows each read W's pairs alone: at half the FMAs' rate the instruction, not the loads, bound it);
   a chunk of LORA_FMA_COLS columns of their sums is kept, then y's update runs under the caller's MXCSR, as
   lora_rows_update's does */
#define LORA_FMA_ROWS 4
#define LORA_FMA_COLS 1024
#ifdef LORA_BF16
/* sums[q][col + 16v] = Σ_j av[q][j] · W[j, mb + 16v] for NR rows q and V vectors v of 16 columns from mb, in
   vdpbf16ps's order (for each pair i, j = 2i + 1 then 2i); with masked, the first V·16 columns' lanes in m only.
   (Inlined with constant NR and V: the sums stay in registers.) */
static inline __attribute__((always_inline)) void lora_fma_sums(const int NR, const int V, const int masked,
        __mmask16 m, const float* W, int64_t M, int64_t r, int64_t mb, float (*av)[MAX_RANK],
        float (*sums)[LORA_FMA_COLS], int64_t col) {
    __m512 s[LORA_FMA_ROWS][4];
    for (int q = 0; q < NR; q++)
        for (int v = 0; v < V; v++) s[q][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < r / 2; i++) {
        __m512 hi[4], lo[4];
        for (int v = 0; v < V; v++) {
            const float* wh = W + (2 * i + 1) * M + mb + 16 * v, *wl = W + 2 * i * M + mb + 16 * v;
            hi[v] = masked ? _mm512_maskz_loadu_ps(m, wh) : _mm512_loadu_ps(wh);
            lo[v] = masked ? _mm512_maskz_loadu_ps(m, wl) : _mm512_loadu_ps(wl);
        }
        for (int q = 0; q < NR; q++) {
            const __m512 bh_ = _mm512_set1_ps(av[q][2 * i + 1]), bl_ = _mm512_set1_ps(av[q][2 * i]);
            for (int v = 0; v < V; v++) s[q][v] = _mm512_fmadd_ps(hi[v], bh_, s[q][v]);
            for (int v = 0; v < V; v++) s[q][v] = _mm512_fmadd_ps(lo[v], bl_, s[q][v]);
        }
    }
    for (int q = 0; q < NR; q++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(sums[q] + col + 16 * v, s[q][v]);
}
#endif
static int lora_rows_update_fma(uint16_t* y, int64_t ldy, const uint16_t* a, int64_t r, const float* W, int64_t M,
                                float scale, int64_t n0, int64_t n1) {
    int bad = 0;
#ifdef LORA_BF16
    __mmask16 seen = 0;
    const __m512 sv = _mm512_set1_ps(scale);
    const unsigned csr = _mm_getcsr();
    float av[LORA_FMA_ROWS][MAX_RANK];
    float sums[LORA_FMA_ROWS][LORA_FMA_COLS];
    for (int64_t n = n0; n < n1; n += LORA_FMA_ROWS) {
        const int nr = n1 - n < LORA_FMA_ROWS ? (int)(n1 - n) : LORA_FMA_ROWS;
        for (int q = 0; q < nr; q++)
            for (int64_t j = 0; j < r; j++) av[q][j] = f32_from_bf16(a[(n + q) * r + j]);
        for (int64_t c0 = 0; c0 < M; c0 += LORA_FMA_COLS) {
            const int64_t c1 = c0 + LORA_FMA_COLS < M ? c0 + LORA_FMA_COLS : M;
            _mm_setcsr(csr | 0x8040);  /* FTZ and DAZ for the sums, as vdpbf16ps */
            int64_t mb = c0;
            for (; mb + 64 <= c1; mb += 64) {  /* 64 columns: 4 vectors of sums a row */
                if (nr == LORA_FMA_ROWS)
                    lora_fma_sums(LORA_FMA_ROWS, 4, 0, 0, W, M, r, mb, av, sums, mb - c0);
                else  /* the last rows, one at a time: the same sums */
                    for (int q = 0; q < nr; q++) lora_fma_sums(1, 4, 0, 0, W, M, r, mb, av + q, sums + q, mb - c0);
            }
            for (; mb < c1; mb += 16)  /* the rest, 16 columns at a time (masked) */
                for (int q = 0; q < nr; q++)
                    lora_fma_sums(1, 1, 1, mask16(c1 - mb), W, M, r, mb, av + q, sums + q, mb - c0);
            _mm_setcsr(csr);
            for (int q = 0; q < nr; q++) {  /* y = bf16(y + scale * sums), as lora_rows_update writes it */
                uint16_t* yn = y + (n + q) * ldy;
                for (int64_t c = c0; c < c1; c += 16) {
                    const int64_t left = c1 - c < 16 ? c1 - c : 16;
                    seen |= add_scaled16(yn + c, left, _mm512_maskz_loadu_ps(mask16(left), sums[q] + (c - c0)), sv);
                }
            }
        }
    }
    bad = seen != 0;
#endif
    return bad;
}

#ifdef LORA_BF16
/* fp32 masters rounded to bf16 as PyTorch's .to(bfloat16) rounds them: rows (r, K) as they are, or B (M, r) as
   r / 2 rows of pairs (B[m, 2i], B[m, 2i + 1]) for rows_update, or Bᵀ (r, M) */
static void round_rows(const float* A, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(out + i, _mm512_loadu_ps(A + i));
    for (; i < n; i++) out[i] = bf16_from_f32(A[i]);
}
static void col_pairs(const float* B, int64_t M, int64_t r, uint32_t* P) {
    for (int64_t i = 0; i < r / 2; i++)
        for (int64_t m = 0; m < M; m++)
            P[i * M + m] = (uint32_t)bf16_from_f32(B[m * r + 2 * i]) | (uint32_t)bf16_from_f32(B[m * r + 2 * i + 1]) << 16;
}
static void row_pairs(const float* A, int64_t K, int64_t r, uint32_t* P) {
    for (int64_t i = 0; i < r / 2; i++)
        for (int64_t k = 0; k < K; k++)
            P[i * K + k] = (uint32_t)bf16_from_f32(A[2 * i * K + k]) | (uint32_t)bf16_from_f32(A[(2 * i + 1) * K + k]) << 16;
}
/* lora_rows_update_fma's W (r, M): B (M, r) transposed, A (r, K) as it is; each value rounded to bf16 */
static void col_floats(const float* B, int64_t M, int64_t r, float* W) {
    for (int64_t j = 0; j < r; j++)
        for (int64_t m = 0; m < M; m++) W[j * M + m] = f32_from_bf16(bf16_from_f32(B[m * r + j]));
}
static void row_floats(const float* A, int64_t K, int64_t r, float* W) {
    for (int64_t i = 0; i < r * K; i++) W[i] = f32_from_bf16(bf16_from_f32(A[i]));
}
static void transpose_round(const float* B, int64_t M, int64_t r, uint16_t* Bt) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < r; j++) Bt[j * M + m] = bf16_from_f32(B[m * r + j]);
}
#endif

#define LORA_ROW_BLOCK 16  /* rows_dot then rows_update on 16 rows at a time: a and y's rows still in L1 */

/* forward: a = bf16(x·Aᵀ) (N, r), then y += scale·a·Bᵀ in place, rounded once; A (r, K), B (M, r) fp32 masters.
   *nonfinite = 1 when a value of y it wrote is NaN or ±inf, else 0. With y NULL, a only (B unread) */
int lora_forward(const uint16_t* x, int64_t ldx, const float* A, const float* B, int64_t N, int64_t K, int64_t M,
                 int64_t r, float scale, uint16_t* a, uint16_t* y, int64_t ldy, int* nonfinite, int64_t chunks,
                 int threads) {
    *nonfinite = 0;
#ifdef LORA_BF16
    const int amx = lora_amx && K % 32 == 0;
    uint16_t* Ab = amx ? NULL : malloc((size_t)(r * K) * sizeof(uint16_t));
    uint32_t* Ap = amx ? malloc((size_t)(r * K / 2) * sizeof(uint32_t)) : NULL;
    const int use_fma = lora_fma;  /* y's update: B's values as floats (r, M), else its pairs (r / 2, M) */
    uint32_t* P = y ? malloc((size_t)((use_fma ? r : r / 2) * M) * sizeof(uint32_t)) : NULL;
    if (!(Ab || Ap) || (y && !P)) { free(Ab); free(Ap); free(P); return 1; }
    if (Ab) round_rows(A, r * K, Ab);
    if (Ap) amx_pairs(A, K, r, 0, Ap);
    if (P) use_fma ? col_floats(B, M, r, (float*)P) : col_pairs(B, M, r, P);
    LORA_RANGES(N, u0, u1, {
        for (int64_t n = u0; n < u1; n += LORA_ROW_BLOCK) {
            const int64_t e = n + LORA_ROW_BLOCK < u1 ? n + LORA_ROW_BLOCK : u1;
            lora_rows_dot_any(x, ldx, Ab, Ap, K, r, 1.0f, a, n, e);
            if (y && (use_fma ? lora_rows_update_fma(y, ldy, a, r, (const float*)P, M, scale, n, e)
                              : lora_rows_update(y, ldy, a, r, P, M, scale, n, e)))
                __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
        }
    });
    free(Ab);
    free(Ap);
    free(P);
#endif
    return 0;
}

/* backward, from g (N, M), x (N, K) and a (N, r): grad_a = bf16(scale·g·B) (N, r) rows split across threads; then,
   columns split, grad_A = grad_aᵀ·x (r, K) and grad_B = scale·(aᵀ·g)ᵀ (M, r), fp32 (either may be NULL) */
int lora_backward(const uint16_t* g, int64_t ldg, const uint16_t* x, int64_t ldx, const uint16_t* a, const float* B,
                  int64_t N, int64_t K, int64_t M, int64_t r, float scale, uint16_t* grad_a, float* grad_A,
                  float* grad_B, int64_t chunks, int threads) {
#ifdef LORA_BF16
    if (grad_A && !grad_a) return 2;  /* grad_A is summed from grad_a */
    if (grad_a) {
        const int amx = lora_amx && M % 32 == 0;
        uint16_t* Bt = amx ? NULL : malloc((size_t)(r * M) * sizeof(uint16_t));
        uint32_t* Bp = amx ? malloc((size_t)(r * M / 2) * sizeof(uint32_t)) : NULL;
        if (!(Bt || Bp)) return 1;
        if (Bt) transpose_round(B, M, r, Bt);
        if (Bp) amx_pairs(B, M, r, 1, Bp);
        LORA_RANGES(N, u0, u1, lora_rows_dot_any(g, ldg, Bt, Bp, M, r, scale, grad_a, u0, u1));
        free(Bt);
        free(Bp);
    }
    const int64_t kb = grad_A ? (K + 31) / 32 : 0, mb = grad_B ? (M + 31) / 32 : 0;
    const int use_fma = lora_fma;
    const int64_t blocks = kb + mb, words = use_fma ? pair_floats(N, r) : pair_words(N, r);  /* (4 bytes each) */
    uint32_t* pa = grad_A ? malloc((size_t)(words + 1) * sizeof(uint32_t)) : NULL;  /* (+1: never malloc(0)) */
    uint32_t* pb = grad_B ? malloc((size_t)(words + 1) * sizeof(uint32_t)) : NULL;
    /* the running sums, each chunk its own (r + 7) / 8 * 8 rows of 32 per block (allocated here, on the calling
       thread: a malloc on one of OpenMP's threads would give it a heap arena of its own, resident from then on) */
    const int64_t rows = (r + 7) / 8 * 8;
    float* acc = malloc((size_t)(32 * rows * (blocks > 0 ? blocks : 1)) * sizeof(float));
    if ((grad_A && !pa) || (grad_B && !pb) || !acc) { free(pa); free(pb); free(acc); return 1; }
    if (pa) pack_pairs(grad_a, N, r, use_fma, pa);
    if (pb) pack_pairs(a, N, r, use_fma, pb);
    if (chunks > blocks) chunks = blocks;
#define LORA_OUTER(pairs, ...) (use_fma ? lora_cols_outer_fma((const float*)(pairs), __VA_ARGS__) \
                                    : lora_cols_outer((pairs), __VA_ARGS__))
    LORA_RANGES(blocks, u0, u1, {
        if (u0 < kb)
            LORA_OUTER(pa, r, x, ldx, N, K, 1.0f, grad_A, K, 1, u0, u1 < kb ? u1 : kb, acc + 32 * rows * u0);
        if (u1 > kb) {
            const int64_t v0 = u0 > kb ? u0 : kb;
            LORA_OUTER(pb, r, g, ldg, N, M, scale, grad_B, 1, r, v0 - kb, u1 - kb, acc + 32 * rows * v0);
        }
    });
#undef LORA_OUTER
    free(pa);
    free(pb);
    free(acc);
#endif
    return 0;
}

/* grad_x += grad_a·A in place (N, K), rounded once; A (r, K) the fp32 master */
int lora_input_update(uint16_t* grad_x, int64_t ldx, const uint16_t* grad_a, const float* A, int64_t N, int64_t K,
                      int64_t r, int64_t chunks, int threads) {
#ifdef LORA_BF16
    const int use_fma = lora_fma;  /* A's values as floats (r, K), else its pairs (r / 2, K) */
    uint32_t* P = malloc((size_t)((use_fma ? r : r / 2) * K) * sizeof(uint32_t));
    if (!P) return 1;
    use_fma ? row_floats(A, K, r, (float*)P) : row_pairs(A, K, r, P);
    LORA_RANGES(N, u0, u1, (void)(use_fma
        ? lora_rows_update_fma(grad_x, ldx, grad_a, r, (const float*)P, K, 1.0f, u0, u1)
        : lora_rows_update(grad_x, ldx, grad_a, r, P, K, 1.0f, u0, u1)));
    free(P);
#endif
    return 0;
}
"""



class NativeLoRA:
    """The compiled kernels; each call one pass of C, on PyTorch's OpenMP team where the library has OpenMP.

    The arguments are as ``fits`` admits them: x, y, g and grad_x (N, ·) in the kernels' dtype (bf16 here, fp32 for
    ``minituner.native_lora_fp32``, whose library has the same three entry points) with contiguous rows, A (r, in)
    and B (out, r) contiguous fp32 masters, r at most MAX_RANK (even, for these)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype  # of x, y, g, grad_x and of what the kernels hand back for a and grad_a
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._forward, self._backward, self._input_update = lib.lora_forward, lib.lora_backward, lib.lora_input_update
        self._forward.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, f32, ptr, ptr, i64, ptr, i64, i32]
        self._backward.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, f32, ptr, ptr, ptr, i64, i32]
        self._input_update.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]
        for f in (self._forward, self._backward, self._input_update):
            f.restype = ctypes.c_int
        self._split = ThreadSplit("minituner-lora", openmp=bool(lib.mk_openmp()))  # its openmp: off in a forked child
        self._use_amx = getattr(lib, "lora_use_amx", None)  # (the bf16 library's; not native_lora_fp32's)
        self.amx = self.use_amx(True)
        self._use_fma = getattr(lib, "lora_use_fma", None)  # (the bf16 library's)
        self.fma = bool(self._use_fma(-1)) if self._use_fma is not None else False  # the build's own choice

    def use_fma(self, on: bool) -> bool:
        """Sum the masters' gradients (grad_A, grad_B) and y's and grad_x's updates in fp32 FMAs rather than in
        vdpbf16ps: the same bits; the library's default is FMAs where it was built for a CPU with AMX (on the one
        measured, vdpbf16ps ran at half an FMA's rate). Returns whether they run in FMAs from now on (in this
        process)."""
        self.fma = bool(self._use_fma(int(on))) if self._use_fma is not None else False
        return self.fma

    def use_amx(self, on: bool) -> bool:
        """Run x·Aᵀ and g·B on AMX's tiles where the CPU has them (and Linux grants them), else on vdpbf16ps;
        returns whether they run on AMX from now on (in this process)."""
        self.amx = bool(self._use_amx(int(on))) if self._use_amx is not None else False
        return self.amx

    def _threads(self, values: int) -> tuple[int, int]:
        """(chunks, threads) for a call reading about `values` values: OpenMP's threads from MIN_VALUES_PER_THREAD
        each, else this one."""
        if not self._split.openmp or values < 2 * MIN_VALUES_PER_THREAD:
            return 1, 1
        threads = min(torch.get_num_threads(), CPU_COUNT, values // MIN_VALUES_PER_THREAD)
        return max(threads, values // CHUNK_VALUES), threads

    @staticmethod
    def _check(rc: int) -> None:
        if rc == 1:
            raise MemoryError("minituner.native_lora: out of memory for a kernel's scratch (its copy of the adapter, "
                              "or the masters' running sums)")
        if rc:
            raise ValueError("minituner.native_lora: the masters' gradients need grad_a")

    def forward_(self, y: Tensor, x: Tensor, A: Tensor, B: Tensor, scale: float) -> tuple[Tensor, bool]:
        """(a, finite): a = x·Aᵀ (N, r; bf16: rounded); y (N, out) += scale·a·Bᵀ in place, rounded once; finite:
        whether every value written into y is finite (each checked as it is stored, while in L1). bf16: A and B are
        rounded to bf16 as .to(torch.bfloat16) rounds them."""
        (n, k), (m, r) = x.shape, B.shape
        a = torch.empty(n, r, dtype=self.dtype)
        nonfinite = ctypes.c_int(0)
        self._check(self._forward(x.data_ptr(), x.stride(0), A.data_ptr(), B.data_ptr(), n, k, m, r, scale,
                                  a.data_ptr(), y.data_ptr(), y.stride(0), ctypes.byref(nonfinite),
                                  *self._threads(n * (k + m))))
        return a, not nonfinite.value

    def down(self, x: Tensor, A: Tensor) -> Tensor:
        """a = x·Aᵀ (N, r; bf16: rounded), the bits forward_ gives, y left alone (for a product that adds the adapter
        itself, ``miniquant.nf4_amx``); A rounded to bf16 as .to(torch.bfloat16) rounds it. bf16 kernels only."""
        if self.dtype != torch.bfloat16:
            raise ValueError("minituner.native_lora: down runs in the bf16 kernels only")
        n, k = x.shape
        r = A.shape[0]
        a = torch.empty(n, r, dtype=self.dtype)
        nonfinite = ctypes.c_int(0)
        self._check(self._forward(x.data_ptr(), x.stride(0), A.data_ptr(), None, n, k, 0, r, 1.0, a.data_ptr(),
                                  None, 0, ctypes.byref(nonfinite), *self._threads(n * k)))
        return a

    def backward(self, g: Tensor, x: Tensor, a: Tensor, B: Tensor, scale: float, need_a: bool = True,
                 need_A: bool = True, need_B: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(grad_a, grad_A, grad_B) from g (N, out), x (N, in), a = x·Aᵀ (N, r) and B: grad_a = scale·g·B (N, r, in
        x's dtype; made when grad_A is asked for too), grad_A = grad_aᵀ·x (r, in) and grad_B = scale·gᵀ·a (out, r),
        both fp32; None for what is not asked for."""
        (n, k), (m, r) = x.shape, B.shape
        g, a = g.contiguous(), a.contiguous()
        grad_a = torch.empty(n, r, dtype=self.dtype) if need_a or need_A else None
        grad_A = torch.empty(r, k, dtype=torch.float32) if need_A else None
        grad_B = torch.empty(m, r, dtype=torch.float32) if need_B else None
        if n == 0:  # no rows: nothing summed (an empty tensor's pointer may be NULL, which the C reads as absent)
            return grad_a, None if grad_A is None else grad_A.zero_(), None if grad_B is None else grad_B.zero_()
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self._check(self._backward(g.data_ptr(), g.stride(0), x.data_ptr(), x.stride(0), a.data_ptr(), B.data_ptr(),
                                   n, k, m, r, scale, ptr(grad_a), ptr(grad_A), ptr(grad_B),
                                   *self._threads(n * (k + 2 * m))))
        return grad_a, grad_A, grad_B

    def input_update_(self, grad_x: Tensor, grad_a: Tensor, A: Tensor) -> Tensor:
        """grad_x (N, in) += grad_a·A in place, rounded once (to bf16, for bf16); grad_a (N, r) in grad_x's dtype."""
        (n, k), r = grad_x.shape, A.shape[0]
        grad_a = grad_a.contiguous()
        self._check(self._input_update(grad_x.data_ptr(), grad_x.stride(0), grad_a.data_ptr(), A.data_ptr(), n, k, r,
                                       *self._threads(n * k)))
        return grad_x


_FAMILY = KernelFamily("lora", _SOURCE, CFLAGS, "minituner's bf16 LoRA kernels", NativeLoRA,
                       vectorized="lora_vectorized", parallel=True)


def kernels() -> NativeLoRA | None:
    """The kernels, built on first use; None where they are off (MINIQUANT_NATIVE=0), cannot be built, or the CPU
    lacks AVX512-BF16 (``lora_vectorized``)."""
    return _FAMILY.kernels()


def takes_bf16_run() -> bool:
    """Whether a bf16 CPU training run's LoRA layers (an even rank, no dropout) run these kernels here (what
    minituner.planner counts: no bf16 copies of the masters)."""
    return kernels() is not None


def _bf16_rows(t: Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def _fp32_master(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous()


def fits(x: Tensor, A: Tensor, B: Tensor) -> bool:
    """Whether these kernels run the adapter A (r, in), B (out, r) on x (N, in): x bf16 on CPU with contiguous rows,
    A and B contiguous fp32 CPU masters of matching shapes, r even and at most MAX_RANK, the kernels built here.
    (The output y and the gradients g and grad_x that go with x are bf16 with contiguous rows as LoRAProduct makes
    them.)"""
    r = A.shape[0] if A.dim() == 2 else 0
    return (_bf16_rows(x) and _fp32_master(A) and _fp32_master(B) and 0 < r <= MAX_RANK and r % 2 == 0
            and A.shape[1] == x.shape[1] and B.shape[1] == r and kernels() is not None)

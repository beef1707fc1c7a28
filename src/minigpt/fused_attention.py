"""Causal self-attention for bf16 on CPUs with bf16 units, on AMX's tiles (Intel Xeon with amx_bf16) or as
AVX512-BF16's dot products (vdpbf16ps: an AMD EPYC of Zen 4 or 5, an Intel Xeon without AMX): forward and backward
each one call of C over blocks of queries, a block's scores never leaving the core's caches.

    if fits(q, k, v):                                  # bf16, head width a multiple of 32, bf16 units usable
        y, lse = kernels().forward(q, k, v, window)    # y (B, h, T, d) laid out (B, T, h, d); lse (B, h, T) fp32
        dq, dk, dv = kernels().backward(q, k, v, dy, lse, window)

It computes what ``minigpt.native_attention``'s GEMM path computes, in the same roundings: S = q·kᵀ summed in fp32
and rounded to bf16, P = softmax(S·d^-½) per row in fp32 (``minikernels.softmax_rows``, the same C as that path's,
reading the fp32 sums and rounding each to bf16 on the way) written in bf16, y = P·v summed in fp32 and rounded
once; backward as FlashAttention-2 does it, P recomputed from the logsumexp (exp(S·d^-½ - lse)), dP = dy·vᵀ rounded
to bf16, dS = P ∘ (dP - D)·d^-½ with D = Σ P ∘ dP, dq = dS·k, dk = dSᵀ·q and dv = Pᵀ·dy each summed in fp32 (dk and
dv over every query head of the K/V group and every block) and rounded once. The sums run in AMX's order (or
vdpbf16ps's: a pair of products added per instruction), not oneDNN's, so a value may differ from that path's in its
last place (tests/minigpt/test_fused_attention.py holds both to fp32 attention and to each other).

Why: on the GEMM path, S, P and dP of a whole K/V group (g·T x T values) go to memory and back between three
GEMMs and two passes of C, the masked half included, and q, k, v are copied into the groups' layout and back. On
an Intel Xeon with AMX (2 threads, 2026-12-06; medians of 15, the two interleaved) one layer's attention, forward
then backward, took at the bench's GPT shape (8 x 128 tokens, 8 heads of 64; P kept there) 3.15 ms on the GEMM
path and 2.74 here; at Llama-3.2-1B's (512 tokens, 32 heads, 8 K/V heads of 64) 16.6 and 9.5 ms; at 1,024 tokens
and heads of 128, 75.7 and 53.6 ms. In the bench's bf16 QLoRA steps (paced, 24 and 12 turns): GPT-shaped 184.8
against 174.7 ms, Llama-1B-shaped (6 layers) 1,191.7 against 1,132.3 ms. On an AMD EPYC (Zen 5) with AVX512-BF16
and no AMX (2 threads, 2026-12-07; medians of 30 and 20, interleaved) 3.17 ms on the GEMM path (P kept) against
1.73 here at the GPT shape, 15.7 against 8.0 ms at Llama-3.2-1B's; the bench's GPT-shaped bf16 QLoRA step 0.95x
and 0.96x (12 rounds each way, the two checkouts' processes alternating). Here a block multiplies only the keys it
can see (the 32-key blocks up to its last query, from its first visible key under a window), its scores stay in a
buffer of the thread's, q, k, v and dy are read where they lie (any strides with unit stride along d; a block's
rows copied together first: a Llama's q rows lie 4 KiB apart, and sixteen such rows would share a cache set), and
dq, dk, dv come back laid out (B, T, heads, d), as the projections' gradients want them.

The products (``mm32``): a 32 x 32 block of fp32 sums, on AMX four tiles (two of A's 16-row tiles by two of B's
16-column strips), k in steps of 32; without AMX, 8 rows at a time by the same two strips, 16 sums in registers,
each row's pair of bf16 values at k = 2p, 2p + 1 broadcast against line p of both strips (vdpbf16ps). B operands are
written in the tiles' layout first, per K/V head: kᵀ and vᵀ (each key's d values as d/2 pairs), k and v (pairs of
keys). The forward takes blocks of 32 queries, split (batch, query head, block) over PyTorch's OpenMP team, the
heaviest first. The backward takes blocks of QB = 64 (S, dP and dq in two halves of 32 rows over the keys the whole
block sees), split by (batch, K/V head), each thread owning its head's sums of dkᵀ = Σ qᵀ·dS and dvᵀ = Σ dyᵀ·P (d x
T, fp32), so a block's P and dS are paired along its 64 queries and its q and dy rows transposed; the sums are
turned back into rows and rounded at the end. Scratch, all allocated on the calling thread and freed before the call
returns: the forward's kᵀ and v in the tiles' layout (the size of k and v) and per thread 32 rows of scores (fp32
and bf16) and a block of output; the backward per thread its K/V head's k, kᵀ, vᵀ in the tiles' layout, the fp32 dkᵀ
and dvᵀ, and a block's S, P, dS and their pairs (about 2.6 MiB at 1,024 tokens and heads of 128).

Used by ``minigpt.native_attention.causal_attention`` where ``fits``: the library built for AVX512-BF16
(``fused_attn_built``: -march=native on a CPU that has it; with -mamx-tile where the CPU has AMX too, then
``fused_attn_tiles``), Linux's permission for the tiles where built for them (asked once, ``usable``), d a multiple
of 32 up to MAX_HEAD_DIM; native_attention's own conditions (bf16 on CPU, T queries over the same T keys, T at most
its MAX_TOKENS) come first. P is never kept for backward here (``native_attention.keeps_probabilities`` says so to
the planner). ``gemms_only`` (the bench's floor) runs the same calls with the softmax and its gradient left out: the
products and the packing of their operands, timed alone.
"""
from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from minikernels.amx_tiles import AMX_TILES_C
from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, cpu_flag_set
from minikernels.softmax_rows import SOFTMAX_ROWS_C
from minikernels.transpose16 import TRANSPOSE16_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]
MAX_HEAD_DIM = 256  # head widths up to this (a multiple of 32) run here
BF16_UNITS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo's flags of the CPUs this runs on

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + SOFTMAX_ROWS_C + AMX_TILES_C + TRANSPOSE16_C + r"""
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSEDATTN 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#endif
int fused_attn_built(void) {
#ifdef FUSEDATTN
    return 1;
#else
    return 0;
#endif
}
int fused_attn_tiles(void) {  /* 1: the products on AMX's tiles; 0: as vdpbf16ps (AVX512-BF16) */
#if defined(FUSEDATTN) && defined(MK_AMX)
    return 1;
#else
    return 0;
#endif
}
int fused_attn_permit(void) {
#if defined(FUSEDATTN) && defined(MK_AMX)
    return mk_amx_permit();
#else
    return 1;  /* no tiles: nothing to ask Linux for */
#endif
}
#ifdef FUSEDATTN
static inline int64_t up32(int64_t n) { return (n + 31) / 32 * 32; }
static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
/* c (32 x 32 fp32, rows ldc apart) = (acc: c +) a (32 rows of K bf16, lda apart) · B, B's two 16-column strips at
   b0 and b1 in the tiles' layout (line p: the pairs of rows 2p and 2p + 1, 64 bytes apart); K a multiple of 32 */
#ifdef MK_AMX
#define TILES_CONFIG() mk_tiles_2x2_config()
#define TILES_RELEASE() _tile_release()
static inline void mm32(const uint16_t* a, int64_t lda, const uint32_t* b0, const uint32_t* b1, int64_t K, float* c,
                        int64_t ldc, int acc) {
    if (acc) {
        _tile_loadd(0, c, ldc * 4); _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4); _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
    } else { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    mk_tiles_2x2(a, lda, b0, b1, 0, K);
    _tile_stored(0, c, ldc * 4); _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4); _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}
#else  /* AVX512-BF16: vdpbf16ps over 8 rows by the two strips at a time, 16 sums in registers */
#define TILES_CONFIG()
#define TILES_RELEASE()
static inline void mm32(const uint16_t* a, int64_t lda, const uint32_t* b0, const uint32_t* b1, int64_t K, float* c,
                        int64_t ldc, int acc) {
    for (int64_t r = 0; r < 32; r += 8) {
        __m512 s0[8], s1[8];
        for (int i = 0; i < 8; i++) {
            s0[i] = acc ? _mm512_loadu_ps(c + (r + i) * ldc) : _mm512_setzero_ps();
            s1[i] = acc ? _mm512_loadu_ps(c + (r + i) * ldc + 16) : _mm512_setzero_ps();
        }
        const uint16_t* ar = a + r * lda;
        for (int64_t p = 0; p < K / 2; p++) {  /* line p: the pairs of k = 2p and 2p + 1 */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * 16);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + p * 16);
            for (int i = 0; i < 8; i++) {
                int32_t pair;  /* row r + i's two values at k = 2p, 2p + 1, against each column's pair */
                memcpy(&pair, ar + i * lda + 2 * p, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                s0[i] = _mm512_dpbf16_ps(s0[i], x, w0);
                s1[i] = _mm512_dpbf16_ps(s1[i], x, w1);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(c + (r + i) * ldc, s0[i]);
            _mm512_storeu_ps(c + (r + i) * ldc + 16, s1[i]);
        }
    }
}
#endif
/* B = Xᵀ for X (n rows of d bf16, ld apart; rows n..np zero): strips of 16 of X's rows, each d/2 lines of their pairs
   (line p of strip s holds word p of rows 16s..16s + 15): 16 rows' 16 words transposed at a time */
static void pack_rows_as_columns(const uint16_t* x, int64_t ld, int64_t n, int64_t np, int64_t d, uint32_t* dst) {
    const int64_t P = d / 2;
    for (int64_t s = 0; s < np / 16; s++)
        for (int64_t w0 = 0; w0 < P; w0 += 16) {
            __m512i r[16];
            for (int64_t j = 0; j < 16; j++)
                r[j] = 16 * s + j < n ? _mm512_loadu_si512(x + (16 * s + j) * ld + 2 * w0) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(dst + (s * P + w0 + p) * 16, r[p]);
        }
}
/* B = X for X (n rows of `cols` bf16, ld apart; rows n..np zero), k along the rows: strips of 16 columns, each np/2
   lines (line p: the pairs (X[2p][c], X[2p + 1][c])); np and cols multiples of 16 */
static void pack_rows_in_pairs(const uint16_t* x, int64_t ld, int64_t n, int64_t np, int64_t cols, uint32_t* dst) {
    const int64_t Q = np / 2;
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t p = 0; p < Q; p++) {
        const uint16_t* r0 = x + 2 * p * ld;
        const uint16_t* r1 = r0 + ld;
        for (int64_t c = 0; c < cols; c += 16) {
            const __m256i lo = 2 * p < n ? _mm256_loadu_si256((const __m256i*)(r0 + c)) : zero;
            const __m256i hi = 2 * p + 1 < n ? _mm256_loadu_si256((const __m256i*)(r1 + c)) : zero;
            const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                              _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
            _mm512_storeu_si512(dst + ((c / 16) * Q + p) * 16, w);
        }
    }
}
/* dst (d x 32, rows ldd apart) = the transpose of X (32 rows of d bf16, ld apart; rows from n on zero): the rows'
   pairs transposed 16 rows at a time, each pair's two halves then the rows of two columns */
static void transpose_block(const uint16_t* x, int64_t ld, int64_t n, int64_t d, uint16_t* dst, int64_t ldd) {
    for (int64_t w0 = 0; w0 < d / 2; w0 += 16) {
        __m512i r[2][16];
        for (int64_t h = 0; h < 2; h++) {
            for (int64_t j = 0; j < 16; j++) {
                const int64_t i = 16 * h + j;
                r[h][j] = i < n ? _mm512_loadu_si512(x + i * ld + 2 * w0) : _mm512_setzero_si512();
            }
            transpose16(r[h]);
        }
        for (int64_t p = 0; p < 16; p++) {  /* columns 2(w0 + p) (the low halves) and 2(w0 + p) + 1 */
            uint16_t* even = dst + 2 * (w0 + p) * ldd;
            for (int64_t h = 0; h < 2; h++) {
                _mm256_storeu_si256((__m256i*)(even + 16 * h), _mm512_cvtepi32_epi16(r[h][p]));
                _mm256_storeu_si256((__m256i*)(even + ldd + 16 * h),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[h][p], 16)));
            }
        }
    }
}
/* the fp32 sums st (d x Tp, Tp apart; column t the sums of row t) rounded into rows [0, T) of dst (d values each,
   row_stride apart): 16 x 16 blocks transposed */
static void rows_from_columns(const float* st, int64_t Tp, int64_t T, int64_t d, uint16_t* dst, int64_t row_stride) {
    for (int64_t t0 = 0; t0 < T; t0 += 16)
        for (int64_t c0 = 0; c0 < d; c0 += 16) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(st + (c0 + i) * Tp + t0);
            transpose16(r);
            for (int64_t t = 0; t < 16 && t0 + t < T; t++)
                store16(dst + (t0 + t) * row_stride + c0, _mm512_castsi512_ps(r[t]));
        }
}
/* rows of fp32 sums (ld apart) rounded to bf16 (store16), `cols` (a multiple of 16) each */
static void round_rows(const float* s, int64_t ld, int64_t rows, int64_t cols, uint16_t* dst, int64_t ldd) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t c = 0; c < cols; c += 16) store16(dst + i * ldd + c, _mm512_loadu_ps(s + i * ld + c));
}
/* the block of queries [t0, t0 + rows) sees the keys [*klo, *klo + *nk): from the 32-key block of its first query's
   first visible key to the 32-key block of its last query (T at most) */
static inline void block_keys(int64_t t0, int64_t rows, int64_t T, int64_t window, int64_t* klo, int64_t* nk) {
    const int64_t first = window > 0 && t0 + 1 > window ? t0 + 1 - window : 0;
    const int64_t end = t0 + rows < T ? t0 + rows : T;
    *klo = first / 32 * 32;
    *nk = up32(end - *klo);
}
/* s32 (32 x nk fp32, rows ld apart) = the block's 32 rows a (lda apart) times Bᵀ's strips from key klo (kt: a K/V
   head's rows in pack_rows_as_columns' layout, d/2 lines a strip) */
static void scores(const uint16_t* a, int64_t lda, const uint32_t* kt, int64_t d, int64_t klo, int64_t nk, float* s32,
                   int64_t ld) {
    for (int64_t j = 0; j < nk; j += 32) {
        const uint32_t* b0 = kt + ((klo + j) / 16) * (d / 2) * 16;
        mm32(a, lda, b0, b0 + (d / 2) * 16, d, s32 + j, ld, 0);
    }
}
/* out (32 x d fp32, rows d apart) = p (32 rows of nk bf16, ld apart) times a K/V head's rows klo.. in
   pack_rows_in_pairs' layout (np/2 lines a strip) */
static void times_rows(const uint16_t* p, int64_t ld, const uint32_t* xn, int64_t np, int64_t d, int64_t klo,
                       int64_t nk, float* out) {
    for (int64_t c = 0; c < d; c += 32) {
        const uint32_t* b0 = xn + (c / 16) * (np / 2) * 16 + (klo / 2) * 16;
        mm32(p, ld, b0, b0 + (np / 2) * 16, nk, out + c, d, 0);
    }
}
/* the fp32 rows `out` (32 x d, d apart) rounded into rows t0.. of a (B, T, heads, d) tensor's head, T at most */
static void write_rows(const float* out, int64_t rows, int64_t d, uint16_t* dst, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t c = 0; c < d; c += 16) store16(dst + i * row_stride + c, _mm512_loadu_ps(out + i * d + c));
}
/* a block's 32 rows of x (rows ld apart) copied to pad, d apart, zero past `rows`: the tiles then read the rows
   from consecutive memory, where rows a multiple of 4 KiB apart (a Llama's q, 32 heads of 64) would share cache sets */
static const uint16_t* block_rows(const uint16_t* x, int64_t ld, int64_t rows, int64_t d, uint16_t* pad,
                                  int64_t* lda) {
    if (rows < 32) memset(pad + rows * d, 0, (32 - rows) * (size_t)d * 2);
    for (int64_t i = 0; i < rows; i++) memcpy(pad + i * d, x + i * ld, (size_t)d * 2);
    *lda = d;
    return pad;
}
static inline size_t al64(size_t bytes) { return (bytes + 63) / 64 * 64; }
#endif  /* FUSEDATTN */

/* y (B, T, h, d) and lse (B, h, T) fp32 of causal attention over q (B, h, T, d), k and v (B, kv, T, d), each
   given by its three strides (batch, head, token; elements, unit along d), at most `window` keys back where window
   > 0. gemms_only: the products alone (the softmax left out; y and lse meaningless). Returns 1 where its scratch
   could not be allocated (nothing written), else 0 */
int fused_attn_forward(const uint16_t* q, int64_t qb, int64_t qh, int64_t qt, const uint16_t* k, int64_t kb,
                     int64_t kh, int64_t kt, const uint16_t* v, int64_t vb, int64_t vh, int64_t vt, int64_t B,
                     int64_t h, int64_t kv, int64_t T, int64_t d, int64_t window, float scale, uint16_t* y,
                     float* lse, int gemms_only, int threads) {
#ifdef FUSEDATTN
    const int64_t Tp = up32(T), g = h / kv, nqb = Tp / 32, head = Tp * d / 2;  /* words of one packed head */
    const int64_t ld = Tp + 32;  /* the scores' rows: not a power of 2 apart, so 16 rows spread over cache sets */
    const size_t shared = al64((size_t)B * kv * 2 * head * 4);
    const size_t per = al64(32 * (size_t)ld * 4) + al64(32 * (size_t)ld * 2) + al64(32 * (size_t)d * 2)
                       + al64(32 * (size_t)d * 4);
    char* mem = aligned_alloc(64, shared + per * (size_t)threads);
    if (!mem) return 1;
    uint32_t* packed = (uint32_t*)mem;  /* per (batch, K/V head): kᵀ, then v, in the tiles' layout */
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < B * kv; u++) {
            const int64_t b = u / kv, j = u % kv;
            uint32_t* kp = packed + u * 2 * head;
            pack_rows_as_columns(k + b * kb + j * kh, kt, T, Tp, d, kp);
            pack_rows_in_pairs(v + b * vb + j * vh, vt, T, Tp, d, kp + head);
        }
        char* mine = mem + shared + per * (size_t)thread_id();
        float* s32 = (float*)mine;
        uint16_t* p16 = (uint16_t*)(mine + al64(32 * (size_t)ld * 4));
        uint16_t* qpad = (uint16_t*)((char*)p16 + al64(32 * (size_t)ld * 2));
        float* out = (float*)((char*)qpad + al64(32 * (size_t)d * 2));
        TILES_CONFIG();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < B * h * nqb; w++) {  /* the heaviest blocks (the last queries) first */
            const int64_t t0 = (nqb - 1 - w % nqb) * 32, hq = (w / nqb) % h, b = w / (nqb * h);
            const int64_t rows = T - t0 < 32 ? T - t0 : 32;
            const uint32_t* kp = packed + (b * kv + hq / g) * 2 * head;
            int64_t lda, klo, nk;
            const uint16_t* a = block_rows(q + b * qb + hq * qh + t0 * qt, qt, rows, d, qpad, &lda);
            block_keys(t0, 32, T, window, &klo, &nk);
            scores(a, lda, kp, d, klo, nk, s32, ld);
            if (gemms_only) round_rows(s32, ld, 32, nk, p16, ld);  /* S itself as P */
            float* l = lse + (b * h + hq) * T + t0;
            for (int64_t i = 0; i < 32; i++) {
                if (i >= rows) memset(p16 + i * ld, 0, (size_t)nk * 2);
                else if (!gemms_only)  /* P from the fp32 sums, each rounded to bf16 first */
                    softmax_row(p16 + i * ld, s32 + i * ld, klo, klo + nk, t0 + i, window, scale, l + i, 0);
            }
            times_rows(p16, ld, kp + head, Tp, d, klo, nk, out);
            write_rows(out, rows, d, y + ((b * T + t0) * h + hq) * d, h * d);
        }
        TILES_RELEASE();
    }
    free(mem);
    return 0;
#else
    return 1;
#endif
}

#define QB 64  /* the backward's blocks of queries: dk's and dv's sums take 64 queries a product */
/* dq (B, T, h, d), dk and dv (B, T, kv, d) of the attention above, from q, k, v as its forward took them, dy (B, h,
   T, d; three strides) and the forward's lse, in blocks of QB queries (two halves of 32 rows for S, dP and dq).
   gemms_only as there. Returns 1 where its scratch could not be allocated (nothing written), else 0 */
int fused_attn_backward(const uint16_t* q, int64_t qb, int64_t qh, int64_t qt, const uint16_t* k, int64_t kb,
                      int64_t kh, int64_t kt, const uint16_t* v, int64_t vb, int64_t vh, int64_t vt,
                      const uint16_t* dy, int64_t db, int64_t dh, int64_t dt, const float* lse, int64_t B, int64_t h,
                      int64_t kv, int64_t T, int64_t d, int64_t window, float scale, uint16_t* dq, uint16_t* dk,
                      uint16_t* dv, int gemms_only, int threads) {
#ifdef FUSEDATTN
    const int64_t Tp = up32(T), g = h / kv, head = Tp * d / 2, ld = Tp + 32;  /* ld: as the forward's */
    const size_t sizes[] = {
        (size_t)head * 4, (size_t)head * 4, (size_t)head * 4,  /* kᵀ, vᵀ, k in the tiles' layout */
        (size_t)d * Tp * 4, (size_t)d * Tp * 4,                 /* dkᵀ, dvᵀ: fp32 sums of the K/V head */
        QB * (size_t)ld * 4,                                     /* a block's fp32 sums (S, then dP) */
        QB * (size_t)ld * 2, QB * (size_t)ld * 2,                /* its P and dS in bf16 */
        QB * (size_t)Tp * 2, QB * (size_t)Tp * 2,                /* the two paired along its queries */
        32 * (size_t)d * 2, 32 * (size_t)d * 2,                  /* a half's q and dy rows, zero-padded */
        QB * (size_t)d * 2, QB * (size_t)d * 2,                  /* the block's q and dy rows transposed */
        32 * (size_t)d * 4};                                     /* a half's dq sums */
    enum { KT, VT, KN, DKT, DVT, S32, P16, DS16, PP, DSP, QPAD, DYPAD, QT, DYT, OUT, NBUF };
    size_t offs[NBUF], per = 0;
    for (int i = 0; i < NBUF; i++) { offs[i] = per; per += al64(sizes[i]); }
    char* mem = aligned_alloc(64, per * (size_t)threads);
    if (!mem) return 1;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        char* mine = mem + per * (size_t)thread_id();
        uint32_t *ktp = (uint32_t*)(mine + offs[KT]), *vtp = (uint32_t*)(mine + offs[VT]);
        uint32_t *knp = (uint32_t*)(mine + offs[KN]), *pp = (uint32_t*)(mine + offs[PP]);
        uint32_t* dsp = (uint32_t*)(mine + offs[DSP]);
        float *dkt = (float*)(mine + offs[DKT]), *dvt = (float*)(mine + offs[DVT]), *s32 = (float*)(mine + offs[S32]);
        float* out = (float*)(mine + offs[OUT]);
        uint16_t *p16 = (uint16_t*)(mine + offs[P16]), *ds16 = (uint16_t*)(mine + offs[DS16]);
        uint16_t *qpad = (uint16_t*)(mine + offs[QPAD]), *dypad = (uint16_t*)(mine + offs[DYPAD]);
        uint16_t *qtr = (uint16_t*)(mine + offs[QT]), *dytr = (uint16_t*)(mine + offs[DYT]);
        TILES_CONFIG();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < B * kv; u++) {
            const int64_t b = u / kv, j = u % kv;
            const uint16_t *kj = k + b * kb + j * kh, *vj = v + b * vb + j * vh;
            pack_rows_as_columns(kj, kt, T, Tp, d, ktp);
            pack_rows_as_columns(vj, vt, T, Tp, d, vtp);
            pack_rows_in_pairs(kj, kt, T, Tp, d, knp);
            memset(dkt, 0, (size_t)d * Tp * 4);
            memset(dvt, 0, (size_t)d * Tp * 4);
            for (int64_t hq = j * g; hq < (j + 1) * g; hq++)
                for (int64_t t0 = 0; t0 < T; t0 += QB) {
                    int64_t klo, nk;  /* the keys the whole block sees: both halves' rows span them */
                    block_keys(t0, QB, T, window, &klo, &nk);
                    for (int64_t r0 = 0; r0 < QB; r0 += 32) {
                        const int64_t rows = T - t0 - r0 < 0 ? 0 : T - t0 - r0 < 32 ? T - t0 - r0 : 32;
                        const uint16_t* qrow = q + b * qb + hq * qh + (t0 + r0) * qt;
                        const uint16_t* dyrow = dy + b * db + hq * dh + (t0 + r0) * dt;
                        uint16_t *prow = p16 + r0 * ld, *dsrow = ds16 + r0 * ld;
                        float* srow = s32 + r0 * ld;
                        transpose_block(dyrow, dt, rows, d, dytr + r0, QB);
                        transpose_block(qrow, qt, rows, d, qtr + r0, QB);
                        if (rows == 0) {  /* past T: no queries, P and dS zero */
                            memset(prow, 0, 32 * (size_t)ld * 2);
                            memset(dsrow, 0, 32 * (size_t)ld * 2);
                            continue;
                        }
                        int64_t lq, ldy;
                        const uint16_t* a = block_rows(qrow, qt, rows, d, qpad, &lq);
                        const uint16_t* gy = block_rows(dyrow, dt, rows, d, dypad, &ldy);
                        const float* l = lse + (b * h + hq) * T + t0 + r0;
                        scores(a, lq, ktp, d, klo, nk, srow, ld);  /* S, then P from the logsumexp */
                        if (gemms_only) round_rows(srow, ld, 32, nk, prow, ld);
                        for (int64_t i = 0; i < 32; i++) {
                            if (i >= rows) memset(prow + i * ld, 0, (size_t)nk * 2);
                            else if (!gemms_only) {
                                float li = l[i];
                                softmax_row(prow + i * ld, srow + i * ld, klo, klo + nk, t0 + r0 + i, window, scale,
                                            &li, 1);
                            }
                        }
                        scores(gy, ldy, vtp, d, klo, nk, srow, ld);  /* dP = dy·vᵀ over S's sums, then dS */
                        if (gemms_only) round_rows(srow, ld, 32, nk, dsrow, ld);
                        for (int64_t i = 0; i < 32; i++) {
                            if (i >= rows) memset(dsrow + i * ld, 0, (size_t)nk * 2);
                            else if (!gemms_only)
                                softmax_grad_row(prow + i * ld, dsrow + i * ld, srow + i * ld, klo, klo + nk,
                                                 t0 + r0 + i, window, scale);
                        }
                        times_rows(dsrow, ld, knp, Tp, d, klo, nk, out);  /* dq = dS·k */
                        write_rows(out, rows, d, dq + ((b * T + t0 + r0) * h + hq) * d, h * d);
                    }
                    pack_rows_in_pairs(p16, ld, QB, QB, nk, pp);  /* P and dS paired along the block's queries */
                    pack_rows_in_pairs(ds16, ld, QB, QB, nk, dsp);
                    for (int64_t c = 0; c < d; c += 32)  /* dvᵀ += dyᵀ·P, dkᵀ += qᵀ·dS (keys klo..) */
                        for (int64_t jb = 0; jb < nk; jb += 32) {
                            const int64_t s = jb / 16 * (QB / 2) * 16;  /* strip jb / 16: QB / 2 lines of 16 */
                            const int64_t next = (QB / 2) * 16;
                            mm32(dytr + c * QB, QB, pp + s, pp + s + next, QB, dvt + c * Tp + klo + jb, Tp, 1);
                            mm32(qtr + c * QB, QB, dsp + s, dsp + s + next, QB, dkt + c * Tp + klo + jb, Tp, 1);
                        }
                }
            /* dk, dv (B, T, kv, d): the transposed sums rounded once */
            rows_from_columns(dkt, Tp, T, d, dk + (b * T * kv + j) * d, kv * d);
            rows_from_columns(dvt, Tp, T, d, dv + (b * T * kv + j) * d, kv * d);
        }
        TILES_RELEASE();
    }
    free(mem);
    return 0;
#else
    return 1;
#endif
}
"""


class FusedAttention:
    """The compiled forward and backward, each one call of C on PyTorch's OpenMP team where built with OpenMP."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        strided = [ptr, i64, i64, i64]
        self._forward = lib.fused_attn_forward
        self._forward.argtypes = [*strided * 3, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, i32, i32]
        self._forward.restype = i32
        self._backward = lib.fused_attn_backward
        self._backward.argtypes = [*strided * 4, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, ptr, i32, i32]
        self._backward.restype = i32
        self._permit = lib.fused_attn_permit
        self._permit.restype = i32
        self.tiles = bool(lib.fused_attn_tiles())  # the products on AMX's tiles, else as AVX512-BF16's vdpbf16ps
        self._openmp = bool(lib.mk_openmp())
        self._permitted: bool | None = None

    def permitted(self) -> bool:
        """Whether Linux lets this process use the tiles (asked once; True where built without them)."""
        if self._permitted is None:
            self._permitted = bool(self._permit())
        return self._permitted

    def _check(self) -> None:
        if not self.permitted():  # the tiles' first instruction would kill the process (SIGILL)
            raise RuntimeError("minigpt.fused_attention: Linux did not grant this process AMX's tiles")

    def _threads(self, units: int) -> int:
        return max(1, min(torch.get_num_threads(), units)) if self._openmp else 1

    def forward(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, gemms_only: bool = False
                ) -> tuple[Tensor, Tensor]:
        """(y, lse): y (B, h, T, d) bf16, laid out (B, T, h, d); lse (B, h, T) fp32, each query's logsumexp of its
        scaled scores, for the backward. q (B, h, T, d), k and v (B, kv, T, d), bf16 with unit stride along d."""
        self._check()
        B, h, T, d = q.shape
        kv = k.shape[1]
        y = torch.empty(B, T, h, d, dtype=torch.bfloat16)
        lse = torch.empty(B, h, T, dtype=torch.float32)
        rc = self._forward(*_strided(q), *_strided(k), *_strided(v), B, h, kv, T, d, window, 1.0 / math.sqrt(d),
                           y.data_ptr(), lse.data_ptr(), int(gemms_only), self._threads(B * h * ((T + 31) // 32)))
        if rc:
            raise MemoryError("minigpt.fused_attention: out of memory for the forward's scratch")
        return y.transpose(1, 2), lse

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dy: Tensor, lse: Tensor, window: int = 0,
                 gemms_only: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of ``forward``'s y for its gradient dy (B, h, T, d) bf16, unit stride along d: each of q's,
        k's, v's shape, laid out (B, T, heads, d)."""
        self._check()
        B, h, T, d = q.shape
        kv = k.shape[1]
        dq = torch.empty(B, T, h, d, dtype=torch.bfloat16)
        dk, dv = (torch.empty(B, T, kv, d, dtype=torch.bfloat16) for _ in range(2))
        rc = self._backward(*_strided(q), *_strided(k), *_strided(v), *_strided(dy), lse.data_ptr(), B, h, kv, T,
                            d, window, 1.0 / math.sqrt(d), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), int(gemms_only),
                            self._threads(B * kv))
        if rc:
            raise MemoryError("minigpt.fused_attention: out of memory for the backward's scratch")
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _strided(t: Tensor) -> tuple[int, int, int, int]:
    """(pointer, batch, head and token strides) of a (B, heads, T, d) tensor with unit stride along d."""
    return t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)


_FAMILY = KernelFamily("fused_attention", _SOURCE, CFLAGS, "minigpt's fused bf16 attention", FusedAttention, LIBS,
                       vectorized="fused_attn_built", parallel=True)


def kernels() -> FusedAttention | None:
    """The fused attention kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or
    built without bf16 units (AVX512-BF16, with or without AMX)."""
    return _FAMILY.kernels()


def usable() -> bool:
    """Whether the CPU has bf16 units (/proc/cpuinfo's avx512_bf16 or amx_bf16, asked before any build, as the
    planner asks this on every CPU), the kernels are built for them, and, built for AMX's tiles, Linux lets this
    process use them."""
    if not BF16_UNITS & cpu_flag_set():
        return False
    lib = kernels()
    return lib is not None and lib.permitted()


def head_fits(head_dim: int) -> bool:
    """Whether heads of this width run here (a multiple of 32 up to MAX_HEAD_DIM) where the kernels are usable."""
    return head_dim % 32 == 0 and 0 < head_dim <= MAX_HEAD_DIM and usable()


def fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``forward`` takes these (native_attention.fits has said yes to them): heads that fit, unit stride
    along d."""
    return head_fits(q.shape[-1]) and all(t.stride(-1) == 1 for t in (q, k, v))


class _FusedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
        y, lse = kernels().forward(q, k, v, window)
        # q, k, v as given (the projections' or rotary embedding's outputs, kept instead of copies), and the
        # logsumexp that recomputes P
        ctx.save_for_backward(q, k, v, lse)
        ctx.window = window
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels write outside autograd's sight
    def backward(ctx, dy: Tensor):
        q, k, v, lse = ctx.saved_tensors
        dy = dy.to(torch.bfloat16)
        dq, dk, dv = kernels().backward(q, k, v, dy if dy.stride(-1) == 1 else dy.contiguous(), lse, ctx.window)
        return dq, dk, dv, None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """softmax(q·kᵀ/√d, causal; at most `window` keys back where given and > 0) · v in one C call, where ``fits``:
    q (B, h, T, d), k and v (B, kv, T, d) -> (B, h, T, d), laid out (B, T, h, d)."""
    return _FusedCausalAttention.apply(q, k, v, int(window or 0))

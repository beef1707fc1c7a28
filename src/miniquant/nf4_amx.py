"""An NF4 weight's bf16 products on AMX's tiles (Intel Xeon with amx_bf16): the forward x·Wᵀ and the input gradient
g·W of a frozen NF4 layer, each one pass that dequantizes W into the tiles' layout and one GEMM on the tiles (C),
a LoRA adapter's share added inside before the one rounding.

    if fits(x, in_features, out_features, blocksize):   # bf16 x on a CPU with AMX, a weight of fitting shape
        y, finite = kernels().product(x, packed, absmax, blocksize, (out, in), workspace, bias,
                                      adapter=(a, B, scale))                      # x·Wᵀ + b + scale·a·Bᵀ
        grad_x, finite = kernels().product(g, packed, absmax, blocksize, (out, in), workspace, transposed=False,
                                           adapter=(grad_a, A, 1.0))              # g·W + grad_a·A

Elsewhere (and on AMX before this file) the weight is dequantized into the shared workspace in its (out, in)
layout and multiplied by oneDNN's bf16 GEMM, and the adapter is added in a pass of its own over the output
(``minituner.native_lora``). On an Intel Xeon with AMX (2 threads, 2026-12-05) oneDNN ran some of a training step's
products on one of its two threads: the GPT-shaped bench's fc2 forward and fc1 input gradient (1,024 rows, k 2,048,
512 columns) took 2.1-2.3 ms on two threads as on one; this GEMM takes 1.0-1.1 ms (alone, medians of 20, the two
interleaved). Its 32 x 32 output blocks are split over the threads whatever the shape.

The layout: B (K, N), the right operand of A (M, K)·B, as 16-column strips, each K / 2 lines of 16 pairs
(B[2p][n], B[2p + 1][n]) in one uint32 each (the even k low): line p of strip s at ((s·K/2) + p)·16 words. An AMX
tile of B is 16 consecutive lines (32 values of k by 16 columns), 64 bytes apart. For x·Wᵀ, B is Wᵀ (K = in,
N = out: 16 rows of W's codes unpacked, then transposed as 16 x 16 words); for g·W, B is W (K = out, N = in: two
rows of W's codes interleaved). Each value is the one ``dequantize_nf4`` writes (code x absmax in fp32, rounded to
bf16, nearest even), so the operands are the workspace path's; writing them so costs what dequantizing does.

The GEMM: blocks of 32 x 32 outputs, four tiles of fp32 sums (two of A's rows by two of B's strips), over k in
steps of 32 in order, in chunks of KC (a panel's sums kept in memory between them), in panels of MP rows by NP
columns split statically over PyTorch's OpenMP team. After the last k, a LoRA adapter's share (a = x·Aᵀ times Bᵀ
in the forward, grad_a times A in the gradient; r even, at most MAX_RANK: one more step of the tiles, its r values
padded to 32 with zeros, the fp32 master rounded to bf16 as .to(torch.bfloat16) rounds it) is summed apart, and
each output is (sum + bias) + scale·share in fp32, rounded to bf16 once (native_lora rounds the base's product
first, then again with the adapter added); each value written is checked finite. Each output's sums run over k in
the same order whatever the threads' split, so the bits do not depend on it; they are AMX's, not oneDNN's (which
blocks k otherwise): tests/miniquant/test_nf4_amx.py holds them to fp64 references of the same bf16 operands. A
last block of fewer than 32 rows reads its rows from a zero-padded copy; the adapter's input, padded to 32 values
a row, and its pairs for every column are made once a call (M·64 + N·64 bytes, freed before it returns), as that
copy is. Each thread keeps 64 KiB (its panel's sums) in thread-local memory (``scratch_bytes``;
``minituner.planner`` counts it).

Where it is taken: weights of at most MAX_WEIGHT values (2^20: a GPT's 512 x 512 projections and its 512 x 2,048
MLP, a Llama's 512 x 2,048 K/V projections). On the bench's GPT-shaped bf16 QLoRA step (8 layers, d_model 512,
1,024 tokens; Intel Xeon with AMX, 2 threads, 2026-12-05; medians of 24 paced turns, processes alternating) the
step took 199.9 ms against 215.9 on oneDNN's path (our LoRA bf16: 194.4), and 211.0 with only the 512 x 512 weights
here. Llama-3.2-1B's larger weights (2,048 x 2,048, its MLP's 8,192 x 2,048) stayed faster on oneDNN's path, alone
and in the step (the 1B-shaped step, 6 layers, with its 2,048 x 2,048 weights here too: 1,300 against 1,264 ms,
8 turns each).

Used by ``QuantizedLinear.amx_product`` (``minituner.lora_product``'s forward, with the adapter; and
``DequantLinearFunction``'s), ``QuantizedLinear.input_grad_from`` and ``QuantizedLinear.input_grad_adding`` (with
the adapter) where ``fits``: the library built with AMX (``nf4amx_built``: a compiler that knows -mamx-tile, on
a CPU that has it), the CPU's amx_bf16 flag, Linux's permission for the tiles (asked once, ``usable``), bf16 input
with contiguous rows on CPU, in and out multiples of 32, blocks of the code a multiple of 32 values.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.amx_tiles import AMX_TILES_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily
from minikernels.transpose16 import TRANSPOSE16_C

from . import nf4_matmul
from .nf4 import nf4_code_table
from .nf4_unpack import NF4_UNPACK_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
MP, NP = 128, 128  # the C's panel: rows and columns of outputs a thread takes at once (its 32 x 32 blocks inside)
MAX_WEIGHT = 1 << 20  # products with larger weights stay with oneDNN (see the module docstring)
MAX_RANK = 32  # adapters up to this rank are added inside the GEMM (one more step of the tiles)
MIN_MACS_PER_THREAD = 1 << 22  # smaller products stay on the calling thread (handing work over costs ~10 µs)
MIN_PACK_VALUES_PER_THREAD = 1 << 15  # packing: 2 threads gain from 2^15 values on (see NF4Amx.pack)

_SOURCE = OPENMP_PRELUDE + AMX_TILES_C + NF4_UNPACK_C + TRANSPOSE16_C + r"""
#include <stdlib.h>
#include <string.h>
#define MP 128
#define NP 128
#define KC 1024  /* k in chunks of KC: a panel's A (MP x KC) and B (KC x NP) stay in a core's L2 */
#if defined(MK_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NF4AMX 1
#endif
int nf4amx_built(void) {
#ifdef NF4AMX
    return 1;
#else
    return 0;
#endif
}
/* Linux's permission for this process's threads to use the tiles (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked
   once: 1 granted, 0 refused or not built */
int nf4amx_permit(void) {
#ifdef NF4AMX
    return mk_amx_permit();
#else
    return 0;
#endif
}
#ifdef NF4AMX
/* W (rows, cols) NF4 in blocks of bs values (a multiple of 32) in the tiles' layout (see the module docstring), part
   [s0, s1) of it. transposed: B = Wᵀ (K = cols), its strips [s0, s1) (16 rows of W each); else B = W (K = rows),
   the lines of pairs of W's rows [s0, s1) in every strip */
static void pack_strips(const uint8_t* codes, const float* scales, int64_t bs, const float* table16, int64_t rows,
                        int64_t cols, int transposed, uint32_t* dst, int64_t s0, int64_t s1) {
    const __m512 table = _mm512_loadu_ps(table16);
    if (transposed) {
        const int64_t P = cols / 2;
        for (int64_t s = s0; s < s1; s++)
            for (int64_t k0 = 0; k0 < cols; k0 += 32) {
                __m512i r[16];
                for (int j = 0; j < 16; j++) {  /* row j's 32 values in order: word p the pair (2p, 2p + 1) */
                    const int64_t e = (s * 16 + j) * cols + k0;
                    __m512 lo, hi;
                    nf4_32(codes + e / 2, scales[e / bs], table, &lo, &hi);
                    r[j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                }
                transpose16(r);  /* r[p]: pair p of each of the 16 rows */
                uint32_t* out = dst + (s * P + k0 / 2) * 16;
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + 16 * p, r[p]);
            }
    } else {  /* rows [s0, s1) of pairs of W's rows, all its strips: each pair of rows' codes read in order */
        const int64_t Q = rows / 2;
        for (int64_t qb = s0; qb < s1; qb += 16)  /* 16 lines of a strip (1 KiB) written together */
            for (int64_t c0 = 0; c0 < cols; c0 += 32)  /* 32 columns: strips c0 / 16 and c0 / 16 + 1 */
                for (int64_t q = qb; q < qb + 16 && q < s1; q++) {
                    const int64_t e0 = 2 * q * cols + c0, e1 = e0 + cols;
                    __m512 lo0, hi0, lo1, hi1;
                    nf4_32(codes + e0 / 2, scales[e0 / bs], table, &lo0, &hi0);
                    nf4_32(codes + e1 / 2, scales[e1 / bs], table, &lo1, &hi1);
                    _mm512_storeu_si512(dst + (c0 / 16 * Q + q) * 16, pairs16(lo0, lo1));
                    _mm512_storeu_si512(dst + ((c0 / 16 + 1) * Q + q) * 16, pairs16(hi0, hi1));
                }
    }
}
/* a LoRA adapter's pairs for the columns [n_lo, n_hi) in the tiles' layout: per strip of 16 columns, 16 lines p of
   (Wa[2p][n], Wa[2p + 1][n]) (zero from p = r / 2 on), the fp32 master rounded to bf16; Wa (r, N) (A), or given as
   its transpose (N, r) where by_rows (B) */
static void adapter_pairs(const float* Wa, int64_t N, int64_t r, int by_rows, int64_t n_lo, int64_t n_hi,
                          uint32_t* dst) {
    for (int64_t n = n_lo; n < n_hi; n++)
        for (int64_t p = 0; p < 16; p++) {
            uint32_t w = 0;
            if (2 * p < r) {
                const float lo = by_rows ? Wa[n * r + 2 * p] : Wa[2 * p * N + n];
                const float hi = by_rows ? Wa[n * r + 2 * p + 1] : Wa[(2 * p + 1) * N + n];
                w = bf16_bits(lo) | bf16_bits(hi) << 16;
            }
            dst[(((n - n_lo) / 16) * 16 + p) * 16 + (n - n_lo) % 16] = w;
        }
}
/* outputs [m0, m0 + 32) x [n0, n0 + 32) over k in [k0, k1): A's rows from a (lda apart, its row 0 at m0, column 0 at
   k = 0). The sums start from 0 (k0 == 0) or from acc (4 tiles of 16 x 16 fp32), and go back to acc, or, after the
   last k (k1 == K): where xa is given, a LoRA adapter's share summed apart in one more step of the tiles (xa: the
   block's 32 rows of 32 values, r of them the adapter's, the rest 0; ap: the pairs of its two strips), then each
   output (sum + bias) + ascale·share (in fp32, in that order) rounded to bf16 into `rows` rows of C. Returns whether
   a value written is NaN or ±inf */
static int block32(const uint16_t* a, int64_t lda, const uint32_t* Bp, int64_t K, int64_t k0, int64_t k1, int64_t n0,
                   float* acc, const uint16_t* bias, const uint16_t* xa, const uint32_t* ap, float ascale, uint16_t* C,
                   int64_t ldc, int64_t m0, int rows) {
    const uint32_t* b0 = Bp + (n0 / 16) * (K / 2) * 16;
    const uint32_t* b1 = b0 + (K / 2) * 16;
    if (k0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    else {
        _tile_loadd(0, acc, 64); _tile_loadd(1, acc + 256, 64);
        _tile_loadd(2, acc + 512, 64); _tile_loadd(3, acc + 768, 64);
    }
    mk_tiles_2x2(a, lda, b0, b1, k0, k1);
    _tile_stored(0, acc, 64); _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64); _tile_stored(3, acc + 768, 64);
    if (k1 < K) return 0;
    float share[1024] __attribute__((aligned(64)));
    if (xa) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, xa, 64); _tile_loadd(5, xa + 16 * 32, 64);
        _tile_loadd(6, ap, 64); _tile_loadd(7, ap + 256, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_stored(0, share, 64); _tile_stored(1, share + 256, 64);
        _tile_stored(2, share + 512, 64); _tile_stored(3, share + 768, 64);
    }
    const __m512 z = _mm512_setzero_ps(), sc = _mm512_set1_ps(ascale);
    const __m512 bl = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(bias + n0))) : z;
    const __m512 bh = bias ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(bias + n0 + 16))) : z;
    const __m512i expo = _mm512_set1_epi16(0x7F80);
    __mmask32 bad = 0;
    for (int i = 0; i < rows; i++) {
        const int64_t o = (i < 16 ? 0 : 512) + (i % 16) * 16;
        __m512 l = _mm512_add_ps(_mm512_load_ps(acc + o), bl), h = _mm512_add_ps(_mm512_load_ps(acc + o + 256), bh);
        if (xa) {
            l = _mm512_add_ps(l, _mm512_mul_ps(sc, _mm512_load_ps(share + o)));
            h = _mm512_add_ps(h, _mm512_mul_ps(sc, _mm512_load_ps(share + o + 256)));
        }
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(h, l);
        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, expo), expo);
        _mm512_storeu_si512((void*)(C + (m0 + i) * ldc + n0), v);
    }
    return bad != 0;
}
static __thread float t_acc[(MP / 32) * (NP / 32) * 1024] __attribute__((aligned(64)));  /* a panel's sums */
/* panel (pm, pn) of outputs: MP rows from pm·MP by NP columns from pn·NP, k in chunks of KC (each block's sums kept
   in t_acc between them); the last block's rows, where fewer than 32, read from pad (32 rows of K, zero past M).
   With xa (an adapter's input in rows of 32 values, r of them its own, the rest 0, to a whole block past M) and ap
   (its pairs, every strip: adapter_pairs), ascale·xa·Wa is added before the rounding. *nonfinite set where a value
   written is NaN or ±inf */
static void panel(const uint16_t* A, int64_t lda, const uint32_t* Bp, int64_t M, int64_t N, int64_t K,
                  const uint16_t* pad, const uint16_t* bias, const uint16_t* xa, const uint32_t* ap, float ascale,
                  uint16_t* C, int64_t ldc, int64_t pm, int64_t pn, int* nonfinite) {
    const int64_t m_lo = pm * MP, m_hi = m_lo + MP < M ? m_lo + MP : M;
    const int64_t n_lo = pn * NP, n_hi = n_lo + NP < N ? n_lo + NP : N;
    int bad = 0;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K;
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += 32)
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += 32) {
                float* acc = t_acc + (((m0 - m_lo) / 32) * (NP / 32) + (n0 - n_lo) / 32) * 1024;
                const uint16_t* xs = xa ? xa + m0 * 32 : NULL;
                const uint32_t* as = xa ? ap + (n0 / 16) * 256 : NULL;
                if (m0 + 32 <= m_hi)
                    bad |= block32(A + m0 * lda, lda, Bp, K, k0, k1, n0, acc, bias, xs, as, ascale, C, ldc, m0, 32);
                else
                    bad |= block32(pad, K, Bp, K, k0, k1, n0, acc, bias, xs, as, ascale, C, ldc, m0, (int)(m_hi - m0));
            }
    }
    if (bad) __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
}
#endif  /* NF4AMX */
/* dst = the pairs of W (rows, cols; NF4 codes, fp32 scales per block of bs values, the 16 code values in table16)
   in the tiles' layout, as B = Wᵀ (transposed) or B = W; strips split over `threads` threads */
void nf4amx_pack(const uint8_t* codes, const float* scales, int64_t bs, const float* table16, int64_t rows,
                 int64_t cols, int transposed, uint32_t* dst, int threads) {
#ifdef NF4AMX
    const int64_t n = transposed ? rows / 16 : rows / 2;  /* strips, or pairs of rows */
    const int64_t chunks = n < 8 * threads ? n : 8 * threads;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t c = 0; c < chunks; c++)
        pack_strips(codes, scales, bs, table16, rows, cols, transposed, dst, n * c / chunks, n * (c + 1) / chunks);
#endif
}
/* C (M, N; ldc) = A (M, K; lda) · B (+ bias (N,), bf16, where given), B in the tiles' layout (nf4amx_pack); N and K
   multiples of 32. With xa (M, r; bf16, rows contiguous, r even, at most 32) and Wa (fp32: (r, N), or (N, r) where
   by_rows): plus ascale·xa·Wa, a LoRA adapter's share, summed apart and added before the one rounding.
   *nonfinite = 1 where a value written is NaN or ±inf, else 0. Returns 1 where a padded copy (of the last rows,
   or of the adapter's input and pairs) could not be allocated (C incomplete), else 0 */
int nf4amx_gemm(const uint16_t* A, int64_t lda, const uint32_t* Bp, int64_t M, int64_t N, int64_t K,
                const uint16_t* bias, const uint16_t* xa, int64_t r, const float* Wa, int by_rows, float ascale,
                uint16_t* C, int64_t ldc, int* nonfinite, int threads) {
    *nonfinite = 0;
#ifdef NF4AMX
    const int64_t pms = (M + MP - 1) / MP, pns = (N + NP - 1) / NP, m_last = M / 32 * 32;
    /* the last rows, where fewer than 32, zero-padded: made here, on the calling thread (a malloc on one of
       OpenMP's threads would give it a heap arena of its own), read by every panel that ends in them */
    uint16_t* pad = M % 32 ? calloc(32 * (size_t)K, 2) : NULL;
    /* the adapter's input in rows of 32 values (zero past r, and past M to a whole block) and its pairs for every
       strip of columns: made once a call and read by every panel (made per panel, the adapter added 29-40% to a
       product of 1,024 rows, k 512, against 4-14% so; Intel Xeon with AMX, 2 threads, 2026-12-06) */
    const int64_t m_blocks = (M + 31) / 32 * 32;
    uint16_t* xa32 = xa ? calloc((size_t)m_blocks * 32, 2) : NULL;
    uint32_t* ap = xa ? aligned_alloc(64, (size_t)(N / 16) * 256 * 4) : NULL;
    if ((M % 32 && !pad) || (xa && (!xa32 || !ap))) {
        free(pad); free(xa32); free(ap);
        return 1;
    }
    for (int64_t i = m_last; i < M; i++) memcpy(pad + (i - m_last) * K, A + i * lda, (size_t)K * 2);
    if (xa) for (int64_t i = 0; i < M; i++) memcpy(xa32 + i * 32, xa + i * r, (size_t)r * 2);
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        if (xa) {  /* the strips split over the threads, all written before any panel starts (the for's barrier) */
            #pragma omp for schedule(static)
            for (int64_t s = 0; s < N / 16; s++) adapter_pairs(Wa, N, r, by_rows, 16 * s, 16 * s + 16, ap + s * 256);
        }
        mk_tiles_2x2_config();
        #pragma omp for schedule(static) collapse(2)
        for (int64_t pm = 0; pm < pms; pm++)
            for (int64_t pn = 0; pn < pns; pn++)
                panel(A, lda, Bp, M, N, K, pad, bias, xa32, ap, ascale, C, ldc, pm, pn, nonfinite);
        _tile_release();
    }
    free(pad); free(xa32); free(ap);
#endif
    return 0;
}
"""


class NF4Amx:
    """The compiled pack and GEMM; each call one pass of C, on PyTorch's OpenMP team where built with OpenMP."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._pack, self._gemm = lib.nf4amx_pack, lib.nf4amx_gemm
        self._pack.argtypes = [ptr, ptr, i64, ptr, i64, i64, i32, ptr, i32]
        self._pack.restype = None
        self._gemm.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i32, ctypes.c_float, ptr, i64,
                               ptr, i32]
        self._gemm.restype = ctypes.c_int
        self._permit, self._openmp, self._permitted = lib.nf4amx_permit, bool(lib.mk_openmp()), None
        self._table = nf4_code_table("cpu").float().contiguous()  # (16,) the NF4 code values

    def permitted(self) -> bool:
        """Whether Linux lets this process use the tiles (asked once)."""
        if self._permitted is None:
            self._permitted = bool(self._permit())
        return self._permitted

    def _threads(self, work: int, per_thread: int = MIN_MACS_PER_THREAD) -> int:
        """Threads for `work` units (a GEMM's multiply-adds, a pack's values), at least `per_thread` each."""
        if not self._openmp or work < 2 * per_thread:
            return 1
        return max(1, min(nf4_matmul.team_threads(), work // per_thread))

    def pack(self, packed: Tensor, absmax: Tensor, blocksize: int, shape: tuple[int, int], transposed: bool,
             out: Tensor) -> Tensor:
        """W (out, in) NF4 (packed codes, fp32 absmax per block) written into `out` (out·in bf16 values, contiguous)
        in the tiles' layout of B = Wᵀ (transposed) or B = W; returns `out` (its layout is not a tensor's). Split over
        PyTorch's team from 2 x MIN_PACK_VALUES_PER_THREAD values on: on an Intel Xeon with AMX (2 threads,
        2026-12-05; medians of 200 calls, best of 3) 2 threads took 14.2 µs against 25.3 at 512 x 512, 49.7 against
        102.7 at 2,048 x 512, 3.7 against 4.7 at 128 x 256, and 3.0 against 3.2 at 128 x 128."""
        rows, cols = shape
        self._pack(packed.data_ptr(), absmax.data_ptr(), blocksize, self._table.data_ptr(), rows, cols,
                   int(transposed), out.data_ptr(), self._threads(rows * cols, MIN_PACK_VALUES_PER_THREAD))
        return out

    def gemm(self, a: Tensor, b_tiles: Tensor, n: int, bias: Tensor | None = None, xa: Tensor | None = None,
             wa: Tensor | None = None, wa_by_rows: bool = False, scale: float = 1.0) -> tuple[Tensor, bool]:
        """(c, finite): c = a (M, K) bf16 with contiguous rows · B (K, n), B as `pack` wrote it (+ bias (n,) bf16)
        -> (M, n) bf16; with xa (M, r) and wa (``adapter_fits``: fp32, (r, n), or (n, r) where wa_by_rows), plus
        scale·xa·wa summed apart and added before the one rounding (a LoRA adapter's share: a·Bᵀ in the forward,
        grad_a·A in the input's gradient); finite: whether every value written is finite."""
        m, k = a.shape
        c = torch.empty(m, n, dtype=torch.bfloat16)
        if m == 0:
            return c, True
        nonfinite = ctypes.c_int(0)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        rc = self._gemm(a.data_ptr(), a.stride(0), b_tiles.data_ptr(), m, n, k, ptr(bias), ptr(xa),
                        0 if xa is None else xa.shape[1], ptr(wa), int(wa_by_rows), scale, c.data_ptr(), n,
                        ctypes.byref(nonfinite), self._threads(m * n * k))
        if rc:
            raise MemoryError("miniquant.nf4_amx: out of memory for the GEMM's padded copies (the last rows, the "
                              "adapter's input and pairs)")
        return c, not nonfinite.value

    def product(self, a: Tensor, packed: Tensor, absmax: Tensor, blocksize: int, shape: tuple[int, int],
                workspace: Tensor, bias: Tensor | None = None, transposed: bool = True,
                adapter: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, bool]:
        """(c, finite): a·Wᵀ (+ bias) (transposed: a (M, in), the forward) or a·W (a (M, out), the input's
        gradient), W (out, in) NF4 dequantized into `workspace` (out·in bf16 values) in the tiles' layout first;
        with adapter = (xa, wa, scale), a LoRA adapter's share added before the rounding (``gemm``: in the forward
        xa = a = x·Aᵀ and wa = B (out, r); in the gradient xa = grad_a and wa = A (r, in)); finite: every value
        written finite."""
        out_features, in_features = shape
        self.pack(packed, absmax, blocksize, shape, transposed, workspace)
        xa, wa, scale = adapter if adapter is not None else (None, None, 1.0)
        # (positional: the bench records and replays its calls so)
        return self.gemm(a, workspace, out_features if transposed else in_features, bias, xa, wa, transposed, scale)


_FAMILY = KernelFamily("nf4_amx", _SOURCE, CFLAGS, "miniquant's NF4 products on AMX", NF4Amx,
                       vectorized="nf4amx_built", parallel=True)


def kernels() -> NF4Amx | None:
    """The kernels, built on first use; None where native kernels are off (MINIQUANT_NATIVE=0), cannot be built, or
    were built without AMX (``nf4amx_built``)."""
    return _FAMILY.kernels()


def usable() -> bool:
    """Whether the products run here: built with AMX, the CPU's amx_bf16 flag, and Linux's permission granted."""
    if not nf4_matmul.cpu_has_amx():
        return False
    k = kernels()
    return k is not None and k.permitted()


def shape_fits(in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether an (out, in) NF4 weight in blocks of `blocksize` fits: in and out multiples of 32, blocks of a
    multiple of 32 values (so 32 values of a row share a scale)."""
    return in_features % 32 == 0 and out_features % 32 == 0 and out_features > 0 and blocksize % 32 == 0


def adapter_fits(a: Tensor, xa: Tensor, wa: Tensor, columns: int, by_rows: bool) -> bool:
    """Whether ``gemm`` adds this adapter's share xa·wa: xa bf16 (a's rows, r), contiguous, wa a contiguous fp32
    CPU master of `columns` columns ((columns, r) where by_rows, else (r, columns)), r even and at most MAX_RANK."""
    r = xa.shape[1] if xa.dim() == 2 else 0
    return (xa.dtype == torch.bfloat16 and xa.device.type == "cpu" and xa.is_contiguous()
            and xa.shape == (a.shape[0], r) and wa.dtype == torch.float32 and wa.device.type == "cpu"
            and wa.is_contiguous() and wa.shape == ((columns, r) if by_rows else (r, columns))
            and 0 < r <= MAX_RANK and r % 2 == 0)


def weight_fits(in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether layers take these products for an (out, in) NF4 weight in blocks of `blocksize`: its shape fitting
    (``shape_fits``) and of at most MAX_WEIGHT values."""
    return in_features * out_features <= MAX_WEIGHT and shape_fits(in_features, out_features, blocksize)


def fits(a: Tensor, in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether ``product`` takes `a` (x for the forward, g for the input's gradient) with this weight: bf16 on CPU,
    2-D with contiguous rows, the weight fitting (``weight_fits``), the products usable here."""
    return (a.dtype == torch.bfloat16 and a.device.type == "cpu" and a.dim() == 2 and a.stride(1) == 1
            and weight_fits(in_features, out_features, blocksize) and usable())


def takes_bf16_run() -> bool:
    """Whether a bf16 CPU run's products of fitting NF4 weights run here (what minituner.planner counts)."""
    return usable()


def scratch_bytes(threads: int) -> int:
    """Bytes each thread that runs the GEMM keeps in thread-local memory from call to call, summed over `threads`:
    its panel's fp32 sums (MP x NP)."""
    return threads * MP * NP * 4

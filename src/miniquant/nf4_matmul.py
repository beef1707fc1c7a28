"""An NF4 weight's input gradient g·W with bf16 gradients on CPU, the codes unpacked inside the product (C, AVX512-BF16).

    if fits(g, in_features, out_features, blocksize):      # bf16 g on CPU, a weight of fitting shape, kernel built
        grad_x = kernels().input_grad(g, packed, absmax, blocksize, in_features)   # (N, out) · W (out, in) -> (N, in)
    if adapter_fits(g, grad_a, A, in_features):            # a LoRA adapter's share too: g·W + grad_a·A, one rounding
        grad_x = kernels().input_grad(g, packed, absmax, blocksize, in_features, (grad_a, A))
    if gelu_fits(g, h, "none"):                            # and GELU's gradient at h (x was gelu(h)): h's gradient
        grad_h = kernels().input_grad(g, packed, absmax, blocksize, in_features, (grad_a, A), (h, "none"))

A frozen NF4 layer's backward needs its weight again for the input's gradient. Without this file it is
dequantized into the shared bf16 workspace (``miniquant.quantize``): every value written to memory at 2 bytes and
read back by oneDNN's GEMM. Here each thread unpacks the codes of a panel of NB columns and KC rows of W into bf16
pairs, a 128 KiB block that stays in its core's cache, and multiplies the rows of g against it there: the weight
crosses memory at half a byte a value.

The product: a microkernel of MR x NR (14 x 32) fp32 sums in registers, each pair of k one AVX-512 BF16 dot
product (vdpbf16ps: two bf16 products a lane, summed in fp32) of the row's pair of g, broadcast, with the panel's
pairs (W[k][n], W[k + 1][n]); the sums run over k in order, carried across KC chunks in fp32 (the same order as
one chain), then each value is rounded to bf16 once (nearest even, NaN as 0x7FC0, as PyTorch rounds). The
weight's bf16 values are those ``dequantize_nf4`` writes (code x absmax in fp32, rounded to nearest even), so the
operands are exactly the workspace path's. oneDNN's bf16 GEMM on these CPUs runs the same instruction: on an AMD
EPYC with AVX512-BF16 the results were oneDNN's bit for bit at K = out = 512 and within one bf16 rounding at 2,048
(it sums K in another order there); tests/miniquant/test_nf4_matmul.py holds them to an fp64 reference of the same
bf16 operands. vdpbf16ps treats denormal inputs as zero, as oneDNN does here.

Measured (AMD EPYC, Zen 5, AVX512-BF16, 2 threads, 2026-12-05; one call, dequantization included on the workspace
path, medians of 8-40): N 1,024 and W 512 x 512 0.56 ms against 0.66; N 512 and Llama-2-7B's 4,096 x 4,096
18.5 ms against 20.7, its MLP 11,008 x 4,096 and 4,096 x 11,008 48.7 and 50.6 ms against 57.4 and 54.5. The
forward x·Wᵀ the same way (pairs from one row of W's codes, gathered into the panel) was 5-10% slower than the
workspace path at the 7B shapes, and in a training step it changed where malloc's heap left its holes: on the
bench's GPT-shaped step the heap trims of ``minituner.memory.heap`` then fired every step (17,000 page faults,
the step 195 ms against 181), and on the 7B shape the peak resident set rose by about 300 MiB. So the forward
keeps the workspace, and the backward takes this product: the GPT-shaped bf16 QLoRA step 174, 176 and 185 ms
against 183, 182 and 186 (three pairs of processes, medians of 30 steps; peak RSS 555-560 MiB against 541-546),
the 7B one 23.0 and 21.2 s against 24.5 and 22.5 (one process each, two steps) with its peak no higher (7,643 MiB
against 7,702). benchmarks/RESULTS.md has the whole steps.

A LoRA adapter on the weight (``minituner.lora_product``) adds its share of the same gradient, grad_a·A with
grad_a = scale·g·B (N, r) and A (r, in) its fp32 master: here as r / 2 more pairs of k in each microkernel's sums,
after W's, before the one rounding (A's panel, its 32 columns by r / 2 pairs, rounded to bf16 as
.to(torch.bfloat16) rounds it, packed beside W's). Added afterwards (``minituner.native_lora``'s input_update_, or
addmm_) it is one more pass over the (N, in) gradient and a second rounding: on the GPT-shaped bf16 QLoRA step
(AMD EPYC, Zen 5, 2 threads, 2026-12-05) 126 µs of that pass for N 1,024 and in 2,048, 33 µs for in 512; the step
3.3 ms faster in the median of 30 paced turns of two processes (faster in 25 of them).

Where the layer's input was GELU's output (``minituner.lora_product`` with ``gelu``: an MLP's second Linear), the
gradient wanted is GELU's input's: each value, rounded to bf16 as above, is multiplied by GELU's slope at that
input (``minikernels.gelu_slope``, exact or tanh form) and rounded again, the bits ``minigpt.native_gelu``'s
backward gives from the stored product, without storing it and reading it back. On the bench's GPT-shaped bf16
QLoRA step (AMD EPYC, Zen 5, 2 threads, 2026-12-05) fc2's call took 2.67 ms against 2.79 for the product and
GELU's backward apart (alone, N 1,024, in 2,048), and the step 1.3 ms less (median of 40 paced turns, 27 faster).

Rows of g a multiple of 4 KiB apart (out_features a multiple of 2,048: the GPT stack's fc1, Llama's q_proj,
o_proj, gate_proj, up_proj and down_proj) fall into one of L1's sets, 14 rows of a microkernel in a set of 12 ways
(AMD Zen 5; 8 on many Intel cores), so each sweep of the panel's slices read them from L2. Such rows are copied, 14
at a time for each K chunk, into a thread buffer 1,088 bytes apart (``rows_copied``; the same bits: the same
values summed in the same order, tested). Measured (AMD EPYC, Zen 5, 2 threads, 2026-12-07; one call, the adapter
added inside, before/after alternating, medians of the per-pair ratios of 8-30 pairs, two runs): N 1,024 and the
GPT stack's fc1 (2,048 x 512) 0.69x and 0.89x; N 512 at Llama-3.2-1B's q_proj 0.92x, gate_proj 0.84x, down_proj
0.94x; Llama-2-7B's q_proj 0.92x. Rows 2 KiB apart lost 4% to the copy (14 rows in two sets fit), so they are read
in place; other shapes unchanged (0.99-1.01x). A copy of all of g with its rows apart, made once a call, was up to
6% faster again at the 1B and 7B shapes, but it is one more (N, out) tensor alive at the backward's peak; copying
a block ahead while the block before is multiplied gained nothing. In the GPT-shaped bf16 QLoRA step (the two
kernels alternating in one process, 40 pairs) 0.949x (faster in 35) and 0.975x (26), in the 6-layer
Llama-3.2-1B-shaped one (10 pairs) 0.929x (10) and 1.004x (4): the saving was large where the machine ran slow
(the step's median 2.32 s in the first run, 1.93 s in the second).

Work is split in units of NB columns (and of rows too where there are fewer than two units a thread), taken by
PyTorch's OpenMP team one at a time as its threads get free. Each thread keeps its panel (NB·KC bf16) and, for
K over KC, its fp32 sums (rows x NB) from call to call, in mappings of their own outside malloc's heap
(``scratch_bytes``, with an adapter's panel; ``minituner.planner`` counts them).

Used by ``QuantizedLinear.input_grad_from`` (its own Function's backward and ``minituner.lora_product``'s) and,
with the adapter, ``QuantizedLinear.input_grad_adding`` (``minituner.lora_product``'s, where ``adapter_fits`` too)
where ``fits``: the library built with AVX512-BF16 (``nf4mm_vectorized``) on a CPU without AMX (``chosen``: where
it has AMX, oneDNN's GEMM on the tiles beats one vdpbf16ps a lane), bf16 g with contiguous rows, blocks of the code
whose size is a multiple of 32 and divides in_features, out_features a multiple of NR; elsewhere the workspace path
(and the adapter added after it, GELU's gradient applied apart).
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C, BF16_SIGMOID_C
from minikernels.build import CPU_COUNT, CPUINFO, OPENMP_PRELUDE, KernelFamily, ThreadSplit, cpu_flag_set
from minikernels.gelu_slope import GELU_SLOPE_C

from .nf4 import nf4_code_table
from .nf4_unpack import NF4_UNPACK_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
MR, NR, NB, KC = 14, 32, 128, 512  # the C's: microkernel rows and columns, a unit's columns, the K chunk
XLD = KC + 32  # the C's: the row stride of a thread's copy of MR rows of g (rows_copied)
COPY_STRIDE_BYTES = 4096  # the C's: g's rows a multiple of this apart are copied first
MAX_RANK = 1024  # adapters up to this rank are added inside the product (as minituner.native_lora's)
GELU_MODES = {"none": 1, "tanh": 2}  # F.gelu's approximate -> the C's act_mode (exact GELU's slope, the tanh form's)
_AMX_FLAG = "amx_bf16"  # where the CPU has it, oneDNN's GEMM is faster (``chosen``)
MIN_MACS_PER_THREAD = 1 << 22  # smaller products stay on the calling thread (handing work over costs ~10 µs)

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + BF16_SIGMOID_C + GELU_SLOPE_C + NF4_UNPACK_C + r"""
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#define MR 14   /* rows of x per microkernel call: 2 x 14 sums in registers, 2 for the panel's vectors */
#define NR 32   /* columns per microkernel call: two vectors of 16 fp32 sums */
#define NB 128  /* columns of a unit of work: a panel of NB x KC bf16 (128 KiB), unpacked once per K chunk */
#define KC 512  /* the K chunk: sums beyond it carry over in fp32 (acc), in the same order */
#define XLD (KC + 32)  /* the row stride of a thread's copy of MR rows of x: 1,088 bytes, no multiple of 4 KiB */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NF4MM 1
#include <immintrin.h>
#endif
int nf4mm_vectorized(void) {
#ifdef NF4MM
    return 1;
#else
    return 0;
#endif
}
#ifdef NF4MM
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
/* the panel of B[k][n] = W[k][n] (W (K, N): rows k of N codes) for columns [n0, n0 + ncols) and k in [k0, k0 + kc):
   for each 32 columns, kc / 2 rows of 32 pairs (W[k][n], W[k + 1][n]) as uint32, bf16 each (low: the even k) */
static void pack_cols(const uint8_t* codes, const float* scales, int64_t bs, __m512 table, int64_t N, int64_t n0,
                      int64_t ncols, int64_t k0, int64_t kc, uint32_t* P) {
    for (int64_t s = 0; s < ncols / NR; s++) {
        uint32_t* dst = P + s * (kc / 2) * NR;
        for (int64_t kp = 0; kp < kc / 2; kp++) {
            const int64_t e0 = (k0 + 2 * kp) * N + n0 + s * NR, e1 = e0 + N;
            __m512 lo0, hi0, lo1, hi1;
            nf4_32(codes + e0 / 2, scales[e0 / bs], table, &lo0, &hi0);
            nf4_32(codes + e1 / 2, scales[e1 / bs], table, &lo1, &hi1);
            _mm512_storeu_si512(dst + kp * NR, pairs16(lo0, lo1));
            _mm512_storeu_si512(dst + kp * NR + 16, pairs16(hi0, hi1));
        }
    }
}
/* A's panel for columns [n0, n0 + ncols): for each 32 columns, r / 2 rows of 32 pairs (A[2j][n], A[2j + 1][n]),
   each fp32 master rounded to bf16 as PyTorch rounds it (bf16_bits) */
static void pack_adapter(const float* A, int64_t N, int64_t r, int64_t n0, int64_t ncols, uint32_t* PA) {
    for (int64_t s = 0; s < ncols / NR; s++)
        for (int64_t j = 0; j < r / 2; j++)
            for (int64_t c = 0; c < NR; c++) {
                const int64_t n = n0 + s * NR + c;
                PA[(s * (r / 2) + j) * NR + c] = bf16_bits(A[2 * j * N + n]) | bf16_bits(A[(2 * j + 1) * N + n]) << 16;
            }
}
static inline __m256i round_bf16(__m512 v) {  /* nearest even, NaN -> 0x7FC0 */
    __m512i u = _mm512_castps_si512(v);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}
/* the sums c0, c1 of rows [0, ROWS) of XS (LD apart) times PAIRS pairs of k of the panel PP, in k order */
#define PAIR_SUMS(ROWS, XS, LD, PAIRS, PP) \
    for (int64_t kp = 0; kp < (PAIRS); kp++) { \
        const __m512bh b0 = as_bh(_mm512_loadu_si512(PP + kp * NR)), b1 = as_bh(_mm512_loadu_si512(PP + kp * NR + 16)); \
        _Pragma("GCC unroll 16") \
        for (int i = 0; i < ROWS; i++) { \
            const __m512bh a = as_bh(_mm512_set1_epi32(*(const int32_t*)(XS + i * (LD) + 2 * kp))); \
            c0[i] = _mm512_dpbf16_ps(c0[i], a, b0); \
            c1[i] = _mm512_dpbf16_ps(c1[i], a, b1); \
        } \
    }
/* 32 values of a row of y: c rounded to bf16, or where `act` is given, GELU's gradient applied to it first: the
   rounded value times the slope at the activation's input (minikernels.gelu_slope; act_mode 1: exact, 2: tanh),
   rounded again, as minigpt.native_gelu's backward does on the stored y */
static inline void store_row32(uint16_t* y, __m512 c0, __m512 c1, const uint16_t* act, int act_mode) {
    if (act) {
        const __m512 s0 = act_mode == 1 ? gelu_erf_slope16(load16(act)) : gelu_tanh_slope16(load16(act));
        const __m512 s1 = act_mode == 1 ? gelu_erf_slope16(load16(act + 16)) : gelu_tanh_slope16(load16(act + 16));
        c0 = _mm512_mul_ps(round16(c0), s0);
        c1 = _mm512_mul_ps(round16(c1), s1);
    }
    _mm256_storeu_si256((__m256i*)y, round_bf16(c0));
    _mm256_storeu_si256((__m256i*)(y + 16), round_bf16(c1));
}
/* rows [0, ROWS) of x (ldx) times the panel's 32 columns over kc pairs of k: the sums start from acc (first: from 0)
   and go back to acc, or (last) are rounded to bf16 into y (ldy), after the adapter's share where PA is given (and
   times GELU's slope at act's rows, ldy apart, where act is given: store_row32) */
#define KERNEL_BODY(ROWS) \
    __m512 c0[ROWS], c1[ROWS]; \
    for (int i = 0; i < ROWS; i++) { \
        if (first) c0[i] = c1[i] = _mm512_setzero_ps(); \
        else { c0[i] = _mm512_loadu_ps(acc + i * NB); c1[i] = _mm512_loadu_ps(acc + i * NB + 16); } \
    } \
    PAIR_SUMS(ROWS, x, ldx, kc / 2, P) \
    if (last && PA) { /* the adapter's share, grad_a·A: r / 2 more pairs of k, then the one rounding */ \
        PAIR_SUMS(ROWS, xa, ra, ra / 2, PA) \
    } \
    for (int i = 0; i < ROWS; i++) { \
        if (last) store_row32(y + i * ldy, c0[i], c1[i], act ? act + i * ldy : NULL, act_mode); \
        else { _mm512_storeu_ps(acc + i * NB, c0[i]); _mm512_storeu_ps(acc + i * NB + 16, c1[i]); } \
    }
static void kernel_full(const uint16_t* x, int64_t ldx, int64_t kc, const uint32_t* P, float* acc, int first, int last,
                        uint16_t* y, int64_t ldy, const uint16_t* xa, int64_t ra, const uint32_t* PA,
                        const uint16_t* act, int act_mode) { KERNEL_BODY(MR) }
static void kernel_tail(const uint16_t* x, int64_t ldx, int64_t kc, const uint32_t* P, float* acc, int first, int last,
                        uint16_t* y, int64_t ldy, const uint16_t* xa, int64_t ra, const uint32_t* PA,
                        const uint16_t* act, int act_mode, int mr) {
    switch (mr) {
#define TAIL(R) case R: { KERNEL_BODY(R) break; }
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13)
    }
}
static __thread uint32_t* t_panel; static __thread size_t t_panel_cap;
static __thread float* t_acc; static __thread size_t t_acc_cap;
static __thread uint16_t* t_xrows; static __thread size_t t_xrows_cap;
/* this thread's buffer p of at least `need` bytes, kept for the next call (NULL: out of memory); a mapping of its
   own, outside malloc's heap, where a block kept for good would sit between the step's tensors */
static void* grow(void** p, size_t* cap, size_t need) {
    if (need > *cap) {
        if (*p) munmap(*p, *cap);
        need = (need + 4095) / 4096 * 4096;
        *p = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (*p == MAP_FAILED) *p = NULL;
        *cap = *p ? need : 0;
    }
    return *p;
}
/* y[m, n] = sum_k x[m, k] W[k, n] for units [u0, u1) of (N columns in blocks of NB) x (mgroups groups of M rows) */
static int nf4mm_units(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
                       int64_t bs, const float* table16, const uint16_t* xa, int64_t ra, const float* A, uint16_t* y,
                       int64_t ldy, int64_t N, const uint16_t* act, int act_mode, int64_t mgroups, int64_t u0,
                       int64_t u1) {
    const __m512 table = _mm512_loadu_ps(table16);
    const int64_t kc_max = K < KC ? K : KC, ar = xa ? ra : 0;
    uint32_t* P = grow((void**)&t_panel, &t_panel_cap, (size_t)NB * kc_max * 2 + (size_t)(ar / 2) * NB * 4);
    const int64_t mrows = (M + mgroups - 1) / mgroups;
    float* acc = K > KC ? grow((void**)&t_acc, &t_acc_cap, (size_t)(mrows + MR) * NB * 4) : NULL;
    /* rows of x a multiple of 4 KiB apart share one of L1's sets (14 rows in a set of 12 ways, or 8): each MR rows
       of a K chunk are copied XLD apart first, read there by every column slice */
    const int copy_rows = (ldx * 2) % 4096 == 0;
    uint16_t* xrows = copy_rows ? grow((void**)&t_xrows, &t_xrows_cap, (size_t)MR * XLD * 2) : NULL;
    if (!P || (K > KC && !acc) || (copy_rows && !xrows)) return 1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t n0 = (u / mgroups) * NB, ncols = N - n0 < NB ? N - n0 : NB;
        const int64_t m0 = (u % mgroups) * mrows, m1 = m0 + mrows < M ? m0 + mrows : M;
        uint32_t* PA = ar ? P + NB * kc_max / 2 : NULL;  /* (after W's panel of NB x kc_max bf16) */
        if (PA) pack_adapter(A, N, ar, n0, ncols, PA);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            const int first = k0 == 0, last = k0 + kc == K;
            pack_cols(codes, scales, bs, table, N, n0, ncols, k0, kc, P);
            for (int64_t m = m0; m < m1; m += MR) {
                const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                const uint16_t* xm = x + m * ldx + k0;
                int64_t lxm = ldx;
                if (xrows) {
                    for (int i = 0; i < mr; i++) memcpy(xrows + i * XLD, xm + i * ldx, (size_t)kc * 2);
                    xm = xrows, lxm = XLD;
                }
                for (int64_t s = 0; s < ncols / NR; s++) {
                    float* a = acc ? acc + (m - m0) * NB + s * NR : NULL;
                    uint16_t* ys = y + m * ldy + n0 + s * NR;
                    const uint16_t* acts = act ? act + m * ldy + n0 + s * NR : NULL;
                    const uint32_t* Ps = P + s * (kc / 2) * NR;
                    const uint16_t* xas = xa ? xa + m * ar : NULL;
                    const uint32_t* PAs = PA ? PA + s * (ar / 2) * NR : NULL;
                    if (mr == MR) kernel_full(xm, lxm, kc, Ps, a, first, last, ys, ldy, xas, ar, PAs, acts, act_mode);
                    else kernel_tail(xm, lxm, kc, Ps, a, first, last, ys, ldy, xas, ar, PAs, acts, act_mode, mr);
                }
            }
        }
    }
    return 0;
}
#endif  /* NF4MM */
/* y (M, N; ldy) = x (M, K; ldx) · W, W (K, N) an NF4 weight (packed codes, fp32 scales per block of bs values, the
   16 code values in table16), dequantized to bf16 panel by panel: the input's gradient g·W of a product x·Wᵀ. The
   work: units of NB columns by `mgroups` groups of rows, taken one at a time by `threads` threads (1: this one).
   With xa (M, ra; rows contiguous, ra even) and A (ra, N; fp32, rounded to bf16 here), y = x·W + xa·A: a LoRA
   adapter's share of the input's gradient, its ra / 2 pairs summed after W's in the same fp32 sums, one rounding.
   With act (M, N; ldy apart: the input of a GELU whose output was x·Wᵀ's input) and act_mode 1 (exact) or 2 (tanh),
   each value of y rounded is then multiplied by GELU's slope there and rounded again: the gradient for GELU's input.
   Returns 1 when a thread's buffers could not be mapped (y then incomplete), else 0. */
int nf4mm_input_grad(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
                     int64_t bs, const float* table16, const uint16_t* xa, int64_t ra, const float* A, uint16_t* y,
                     int64_t ldy, int64_t N, const uint16_t* act, int act_mode, int64_t mgroups, int threads) {
    int failed = 0;
#ifdef NF4MM
    const int64_t units = (N + NB - 1) / NB * mgroups;
    if (threads > 1) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|:failed)
        for (int64_t u = 0; u < units; u++)
            failed |= nf4mm_units(x, ldx, M, K, codes, scales, bs, table16, xa, ra, A, y, ldy, N, act, act_mode,
                                  mgroups, u, u + 1);
    } else {
        failed = nf4mm_units(x, ldx, M, K, codes, scales, bs, table16, xa, ra, A, y, ldy, N, act, act_mode, mgroups, 0,
                             units);
    }
#endif
    return failed;
}
"""


class NF4Matmul:
    """The compiled product; each call one pass of C, on PyTorch's OpenMP team where the library has OpenMP."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._run = lib.nf4mm_input_grad
        self._run.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i32, i64, i32]
        self._run.restype = ctypes.c_int
        self._split = ThreadSplit("miniquant-nf4mm", openmp=bool(lib.mk_openmp()))  # its openmp: off in a forked child
        self._table = nf4_code_table("cpu").float().contiguous()  # (16,) the NF4 code values

    def _threads(self, m: int, k: int, n: int) -> tuple[int, int]:
        """(threads, row groups) for an (m, k) x (k, n) product: OpenMP's team for a large one; rows split too
        where there are fewer than two column units a thread."""
        if not self._split.openmp or m * k * n < 2 * MIN_MACS_PER_THREAD:
            return 1, 1
        threads = min(team_threads(), m * k * n // MIN_MACS_PER_THREAD)
        units = -(-n // NB)
        groups = 1 if units >= 2 * threads else min(-(-2 * threads // units), max(1, m // MR))
        return threads, groups

    def input_grad(self, g: Tensor, packed: Tensor, absmax: Tensor, blocksize: int, in_features: int,
                   adapter: tuple[Tensor, Tensor] | None = None, gelu: tuple[Tensor, str] | None = None) -> Tensor:
        """g (N, out) bf16 · W -> (N, in) bf16, the gradient of x·Wᵀ for x; W (out, in) NF4: its packed codes
        (out·in / 2 bytes, element 2i in the high nibble of byte i) and fp32 absmax per block of `blocksize`.
        With adapter = (grad_a, A) (``adapter_fits``): g·W + grad_a·A, a LoRA adapter's share of the same gradient
        summed into the same fp32 sums after W's and rounded once with them (A's fp32 master rounded to bf16 as
        .to(torch.bfloat16) rounds it).
        With gelu = (h, approximate) (``gelu_fits``): x was GELU's output for h (N, in), F.gelu's `approximate`
        ("none" or "tanh"); each rounded value is multiplied by GELU's slope at h and rounded again, the gradient
        for h, the bits ``minigpt.native_gelu``'s backward gives from the stored g·W."""
        m, k = g.shape
        grad_x = torch.empty(m, in_features, dtype=torch.bfloat16)
        if m == 0:
            return grad_x
        grad_a, A = adapter if adapter is not None else (None, None)
        h, approximate = gelu if gelu is not None else (None, None)
        threads, groups = self._threads(m, k, in_features)
        rc = self._run(g.data_ptr(), g.stride(0), m, k, packed.data_ptr(), absmax.data_ptr(), blocksize,
                       self._table.data_ptr(), None if grad_a is None else grad_a.data_ptr(),
                       0 if A is None else A.shape[0], None if A is None else A.data_ptr(), grad_x.data_ptr(),
                       in_features, in_features, None if h is None else h.data_ptr(),
                       0 if h is None else GELU_MODES[approximate], groups, threads)
        if rc:
            raise MemoryError("miniquant.nf4_matmul: out of memory for a thread's panel")
        return grad_x


_FAMILY = KernelFamily("nf4_matmul", _SOURCE, CFLAGS, "miniquant's NF4 input-gradient product", NF4Matmul,
                       vectorized="nf4mm_vectorized", parallel=True)


def kernels() -> NF4Matmul | None:
    """The product, built on first use; None where native kernels are off (MINIQUANT_NATIVE=0), cannot be built,
    or the CPU lacks AVX512-BF16 (``nf4mm_vectorized``)."""
    return _FAMILY.kernels()


def chosen() -> bool:
    """Whether layers take this product for their NF4 input gradients here: the kernel built (``kernels``) and the
    CPU without AMX. Where it has AMX (``amx_bf16``) oneDNN's bf16 GEMM runs on its tile units, and the workspace
    path (dequantize, then that GEMM) is several times faster than one vdpbf16ps a lane: on an Intel Xeon with AMX
    (2 threads, 2026-12-05) N 1,024 and W 512 x 512 0.36 ms against 2.67, N 512 and W 8,192 x 2,048 12.4 ms
    against 93.2, dequantization included."""
    return kernels() is not None and not cpu_has_amx()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (``amx_bf16`` among /proc/cpuinfo's flags; read once)."""
    return _AMX_FLAG in cpu_flag_set(CPUINFO)


def shape_fits(in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether an (out, in) NF4 weight in blocks of `blocksize` fits the kernel: blocks of a multiple of 32 values
    that divide each row (so 32 values in a row share a scale), out_features a multiple of NR."""
    return blocksize % 32 == 0 and in_features % blocksize == 0 and out_features % NR == 0 and out_features > 0


def fits(g: Tensor, in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether the kernel computes g (N, out)·W for this weight: g bf16 on CPU with contiguous rows, the weight's
    shape fitting (``shape_fits``), the kernel chosen here (``chosen``)."""
    return (g.dtype == torch.bfloat16 and g.device.type == "cpu" and g.dim() == 2 and g.stride(1) == 1
            and shape_fits(in_features, out_features, blocksize) and chosen())


def adapter_fits(g: Tensor, grad_a: Tensor, A: Tensor, in_features: int) -> bool:
    """Whether input_grad adds this adapter's share grad_a (N, r)·A (r, in): grad_a bf16 with g's rows, contiguous,
    A a contiguous fp32 CPU master, r even (the kernel pairs it) and at most MAX_RANK."""
    r = A.shape[0] if A.dim() == 2 else 0
    return (grad_a.dtype == torch.bfloat16 and grad_a.device.type == "cpu" and grad_a.dim() == 2
            and grad_a.is_contiguous() and grad_a.shape == (g.shape[0], r) and A.dtype == torch.float32
            and A.device.type == "cpu" and A.is_contiguous() and A.shape[1] == in_features
            and 0 < r <= MAX_RANK and r % 2 == 0)


def gelu_fits(g: Tensor, h: Tensor, approximate: str) -> bool:
    """Whether input_grad applies GELU's gradient at h: h bf16 on CPU, contiguous, with g's rows (N, in), and
    `approximate` one of F.gelu's ("none", "tanh")."""
    return (h.dtype == torch.bfloat16 and h.device.type == "cpu" and h.dim() == 2 and h.is_contiguous()
            and h.shape[0] == g.shape[0] and approximate in GELU_MODES)


def takes_bf16_run() -> bool:
    """Whether a bf16 CPU run's NF4 input gradients (of fitting weights) run here (what minituner.planner counts)."""
    return chosen()


def team_threads() -> int:
    """How many threads the kernel's large calls run on here: PyTorch's team, at most the CPUs."""
    return min(torch.get_num_threads(), CPU_COUNT)


def rows_copied(k: int) -> bool:
    """Whether the kernel copies the rows of a contiguous g (N, k) before multiplying them: rows a multiple of 4 KiB
    apart (k a multiple of 2,048) share one of L1's sets."""
    return k * 2 % COPY_STRIDE_BYTES == 0


def scratch_bytes(rows: int, max_k: int, threads: int, rank: int = 0, copies_rows: bool = False) -> int:
    """Bytes each thread keeps from call to call (its panel, with a rank-`rank` adapter's panel after it where the
    call adds one, its fp32 sums for K over KC, and where some call's rows are copied (``rows_copied``) its copy of
    MR rows), summed over `threads`, for gradients of up to `rows` rows and K (the weight's out_features) up to
    `max_k`."""
    panel = NB * min(max_k, KC) * 2 + rank // 2 * NB * 4
    sums = (rows + MR) * NB * 4 if max_k > KC else 0
    copy = MR * XLD * 2 if copies_rows else 0
    return threads * (panel + sums + copy)

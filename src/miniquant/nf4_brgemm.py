"""A large NF4 weight's bf16 products on a CPU with AMX: the forward x·Wᵀ and the input gradient g·W of a frozen NF4
layer, each thread unpacking W panel by panel into its own buffer, in oneDNN's brgemm layout, and multiplying it
at once with oneDNN's brgemm micro-kernel (PyTorch's, ``minikernels.onednn_brgemm``).

    if fits(x, in_features, out_features, blocksize):   # bf16 x on a CPU with AMX, a weight of more than 2^20 values
        y, finite = kernels().product(x, packed, absmax, blocksize, (out, in), bias)              # x·Wᵀ + b
        grad_x, finite = kernels().product(g, packed, absmax, blocksize, (out, in), transposed=False)  # g·W
        y, finite = kernels().product(x, ..., adapter=(a, B, scale))   # x·Wᵀ + b + scale·a·Bᵀ, one rounding

Elsewhere (weights of at most 2^20 values, ``miniquant.nf4_amx``'s; and before this file) the weight is written
whole into the shared workspace, then multiplied: for a weight of this size, through oneDNN's matmul, which first
copies it into the layout its kernel reads, a pass of its own. Here that layout is written straight from the codes,
a panel at a time, in a thread's buffer of 512 KiB that the product reads at once, from the core's caches (its
2 MiB L2 on the machine below, beside the block's fp32 sums and A's rows); W's bf16 values never reach memory.
On an Intel Xeon with AMX (2 threads, 2026-12-06; 512 rows, caches flushed before each call, the two
interleaved, medians of 21 per-call ratios) this product took 0.94 and 0.94x the time of dequantization
into the workspace and oneDNN's matmul for an 8,192 x 2,048 weight's forward (two runs), 0.86 and 0.86x for its
input gradient, 0.82 and 0.87x for 2,048 x 8,192's forward, 0.80 and 0.88x its input gradient, 0.85-0.87x and
0.78-0.81x at 2,048 x 2,048, the products alone (unpack=False) 0.67-0.76x. A third run fell in one of the
machine's slow phases, which slowed this product more (35-50% over the two runs above) than the two-step path
(0-20%): 1.01-1.25x there. In the bench's 6-layer
Llama-3.2-1B-shaped bf16 QLoRA step (benchmarks/bench_bf16.py, 512 tokens; one process, the two paths
alternating step by step, 16 rounds) the products of these weights took 433 ms a step against 512 (forward 228
against 262, input gradient 205 against 250), the step 1,065 against 1,141 ms (medians). With more rows than MB
the weight is unpacked once per MB rows: at 2,048 rows that ran 0.87-1.09x the two-step path (one run), so
layers take this product for at most MB rows.

The layout: B (K, N), the right operand of A (M, K)·B, as K / 2 lines of N pairs (B[2p][n], B[2p + 1][n]) in one
uint32 each (the even k low); a panel of NP columns (fewer for the last) and KC values of k is (KC / 2) lines of
its width. For x·Wᵀ, B is Wᵀ (K = in, N = out): 16 rows of W's codes unpacked, then transposed as 16 x 16 words;
for g·W, B is W (K = out, N = in): two rows of W's codes interleaved. Each value is the one ``dequantize_nf4``
writes (code x absmax in fp32, rounded to bf16, nearest even): a block's 16 rounded once, its nibbles looking them
up 32 at a time.

The GEMM: panels of NP columns split statically over PyTorch's OpenMP team; per panel, rows of A in blocks of MB,
k in chunks of KC, each chunk unpacked and multiplied (brgemm, fp32 sums kept in the thread's buffer between
chunks); after the last chunk each output is sum + bias in fp32, rounded to bf16 once, and checked finite. The
sums of every output run over k in order, 32 at a time, on AMX's tiles, so the bits are ``nf4_amx``'s
(tests/miniquant/test_nf4_brgemm.py holds the two equal) and do not depend on the threads' split. Rows of A
beyond MB unpack each panel again per block of MB rows. brgemm is asked for whole blocks of 32 rows only: the
last M % 32 rows are copied, zero-padded to 32, into a buffer of their own first (on the calling thread), so
PyTorch compiles a few kernel shapes per weight shape, not one per row count (each is kept for the process's
life, about 190 KiB per thread). Each thread's buffer (KC·NP bf16 and MB·NP fp32: 1 MiB) and the padded rows
(32·K bf16) are held from call to call (``scratch_bytes``; ``minituner.planner`` counts them).

A LoRA adapter's share (``adapter=(xa, wa, scale)``, as ``nf4_amx`` takes it) is summed apart after the last k
chunk, from 0, by one more brgemm call per panel and block of rows over ADAPTER_K values (r, padded with zeros: xa's
rows made once a call, M·64 bytes; wa's pairs, the fp32 master rounded to bf16, each panel's together, nw pairs a
line, made by the thread that multiplies it: N·64 bytes in all, both freed before the call returns), into the
thread's panel buffer (its unpacked chunk is spent by then); each output is then (sum + bias) + scale·share in
fp32, rounded once: ``nf4_amx``'s bits with the adapter too. Against the base's product and native_lora's pass
over its output after (Intel Xeon with AMX, 2 threads, 2026-12-06; 512 rows, caches flushed, medians of 21
interleaved per-pair ratios) it took 0.91x for an 8,192 x 2,048 weight's forward, 0.93x and 0.92x for 2,048 x
8,192's forward and input gradient, 0.89x and 0.91x at 2,048 x 2,048, and 1.00x for 8,192 x 2,048's input
gradient. (The pairs first lay as one B of N columns: brgemm then read the adapter's 16 lines N·4 bytes apart,
and an 8,192-column forward took 15.7 ms against 9.7 without the adapter; 10.4 against 9.9 in this layout.)

Used by ``QuantizedLinear.amx_product`` (the forward, with the adapter's share where ``minituner.lora_product``
hands it over), ``QuantizedLinear.input_grad_from`` and ``QuantizedLinear.input_grad_adding`` (with the adapter)
where ``fits``: the library built with AVX512-BF16, PyTorch's brgemm found
(``onednn_brgemm``), a CPU where ``nf4_amx`` runs (AMX and Linux's permission), bf16 input with contiguous rows on
CPU, in and out multiples of 32, blocks a multiple of 32 values, and more than ``nf4_amx.MAX_WEIGHT`` values.
"""
from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor

from minikernels import onednn_brgemm
from minikernels.build import OPENMP_PRELUDE, KernelFamily
from minikernels.transpose16 import TRANSPOSE16_C

from . import nf4_amx, nf4_matmul
from .nf4 import nf4_code_table
from .nf4_unpack import NF4_UNPACK_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
NP, KC, MB = 256, 1024, 512  # the C's panel width, k chunk and rows of A per call (its #defines)
ADAPTER_K = 32  # an adapter's rank padded with zeros to one step of the tiles (the C's #define)
SCRATCH_BYTES = KC * NP * 2 + MB * NP * 4  # per thread: a chunk of a panel unpacked, and its block's fp32 sums
MIN_MACS_PER_THREAD = 1 << 22  # smaller products stay on the calling thread

_SOURCE = OPENMP_PRELUDE + NF4_UNPACK_C + TRANSPOSE16_C + r"""
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#define NP 256
#define KC 1024
#define MB 512
#define SCRATCH_BYTES (KC * NP * 2 + MB * NP * 4)
#define ADAPTER_K 32  /* an adapter's rank, padded with zeros: one step of the tiles */
#define AHEAD_PAIRS 16     /* W: the codes of the pair of rows this many pairs ahead prefetched */
/* at::native::cpublas::brgemm (bf16) and brgemm_release, as minikernels.onednn_brgemm finds them */
typedef void (*brgemm_fn)(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                          const uint16_t* A, const uint16_t* B, float* C, bool is_vnni);
typedef void (*release_fn)(bool is_vnni);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NF4BG 1
#include <immintrin.h>
#endif
int nf4bg_built(void) {
#ifdef NF4BG
    return 1;
#else
    return 0;
#endif
}
#ifdef NF4BG
/* B[k0:k1, n0:n0 + nw] into dst as (k1 - k0) / 2 lines of nw pairs; transposed: B = Wᵀ (B[k][n] = W[n][k]),
   else B = W. W (rows, cols): NF4 codes, fp32 scales per block of bs values */
static void unpack_panel(const uint8_t* codes, const float* scales, int64_t bs, __m512 table, int64_t rows,
                         int64_t cols, int transposed, int64_t k0, int64_t k1, int64_t n0, int64_t nw, uint32_t* dst) {
    if (transposed) {
        for (int64_t s = 0; s < nw; s += 16)
            for (int64_t k = k0; k < k1; k += 32) {
                __m512i r[16];
                for (int j = 0; j < 16; j++) {  /* row n0 + s + j's 32 values from k: word p the pair (2p, 2p + 1) */
                    const int64_t e = (n0 + s + j) * cols + k;
                    /* the next strip's row (16 on) at this k, a 64-byte line of its codes at a time, and its
                       chunk's scales: what the next strip reads first (a row's codes 1,024 values ahead, the next
                       k chunk, came long after: at 512 rows with the caches flushed the forward's unpacking cost
                       2.3-2.9 ms at 8,192 x 2,048 and 2,048 x 8,192, now 1.8-2.5) */
                    if ((k & 127) == 0 && n0 + s + 16 + j < rows) {
                        _mm_prefetch((const char*)(codes + (e + 16 * cols) / 2), _MM_HINT_T0);
                        if (k == k0) _mm_prefetch((const char*)(scales + (e + 16 * cols) / bs), _MM_HINT_T0);
                    }
                    r[j] = _mm512_permutexvar_epi16(nib32(codes + e / 2), lut16(table, scales[e / bs]));
                }
                transpose16(r);  /* r[p]: pair p of each of the 16 rows */
                uint32_t* out = dst + (k - k0) / 2 * nw + s;
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + p * nw, r[p]);
            }
    } else {
        /* 16-bit lanes of the pairs of columns 0-15 (lo) and 16-31 (hi): row 2q's value, then row 2q + 1's */
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int64_t q = k0 / 2; q < k1 / 2; q++) {
            const int64_t e0 = 2 * q * cols + n0, e1 = e0 + cols;
            if (2 * (q + AHEAD_PAIRS) + 1 < rows) {
                const int64_t a0 = e0 + 2 * AHEAD_PAIRS * cols, a1 = a0 + cols;
                for (int64_t c = 0; c < nw / 2; c += 64) {
                    _mm_prefetch((const char*)(codes + a0 / 2 + c), _MM_HINT_T0);
                    _mm_prefetch((const char*)(codes + a1 / 2 + c), _MM_HINT_T0);
                }
                _mm_prefetch((const char*)(scales + a0 / bs), _MM_HINT_T0);
                _mm_prefetch((const char*)(scales + a1 / bs), _MM_HINT_T0);
            }
            for (int64_t c = 0; c < nw; c += 32) {
                const int64_t f0 = e0 + c, f1 = e1 + c;
                const __m512i v0 = _mm512_permutexvar_epi16(nib32(codes + f0 / 2), lut16(table, scales[f0 / bs]));
                const __m512i v1 = _mm512_permutexvar_epi16(nib32(codes + f1 / 2), lut16(table, scales[f1 / bs]));
                uint32_t* out = dst + (q - k0 / 2) * nw + c;
                _mm512_storeu_si512(out, _mm512_permutex2var_epi16(v0, lo, v1));
                _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(v0, hi, v1));
            }
        }
    }
}
/* a LoRA adapter's pairs for the panel of columns [n0, n0 + nw) as brgemm's B (ADAPTER_K values of k: ADAPTER_K / 2
   lines of nw pairs (Wa[2p][n], Wa[2p + 1][n]), zero from p = r / 2 on), the fp32 master rounded to bf16 (nearest
   even); Wa (r, N), or given as its transpose (N, r) where by_rows */
static void adapter_pairs(const float* Wa, int64_t N, int64_t r, int by_rows, int64_t n0, int64_t nw,
                          uint32_t* dst) {
    for (int64_t p = 0; p < ADAPTER_K / 2; p++)
        for (int64_t n = n0; n < n0 + nw; n++) {
            uint32_t w = 0;
            if (2 * p < r) {
                const float lo = by_rows ? Wa[n * r + 2 * p] : Wa[2 * p * N + n];
                const float hi = by_rows ? Wa[n * r + 2 * p + 1] : Wa[(2 * p + 1) * N + n];
                w = bf16_bits(lo) | bf16_bits(hi) << 16;
            }
            dst[p * nw + n - n0] = w;
        }
}
#endif  /* NF4BG */
/* C (M, N; ldc) = A (M, K; bf16, rows lda apart) · B (+ bias (N,) bf16 where given), rounded to bf16 once; B = Wᵀ
   (transposed: K = cols, N = rows) or W (K = rows, N = cols), W (rows, cols) NF4 (codes, fp32 scales per block of bs
   values, the 16 code values in table16); N and K multiples of 32, bs a multiple of 32. scratch: SCRATCH_BYTES per
   thread, then 32 rows of K bf16 (A's last M % 32 rows, zero-padded: brgemm is only ever asked for a multiple of 32
   rows, so few shapes are compiled), 64-byte aligned. unpack = 0 multiplies whatever each thread's buffer holds
   instead of unpacking W (the products alone: the bench's floor). *nonfinite = 1 where a value written is NaN or
   ±inf, else 0 */
int nf4bg_product(const uint16_t* A, int64_t lda, const uint8_t* codes, const float* scales, int64_t bs,
                  const float* table16, int64_t rows, int64_t cols, int transposed, int64_t M, const uint16_t* bias,
                  const uint16_t* xa, int64_t r, const float* Wa, float ascale, uint16_t* C, int64_t ldc,
                  uint8_t* scratch, int unpack, int* nonfinite, int threads, brgemm_fn brgemm, release_fn release) {
    *nonfinite = 0;
#ifdef NF4BG
    const int64_t N = transposed ? rows : cols, K = transposed ? cols : rows, panels = (N + NP - 1) / NP;
    const int64_t m_whole = M / 32 * 32;
    uint16_t* pad = (uint16_t*)(scratch + (size_t)threads * SCRATCH_BYTES);
    if (M > m_whole)  /* made here, on the calling thread, before any panel reads it */
        for (int64_t i = 0; i < 32; i++) {
            if (m_whole + i < M) memcpy(pad + i * K, A + (m_whole + i) * lda, (size_t)K * 2);
            else memset(pad + i * K, 0, (size_t)K * 2);
        }
    /* the adapter's input in rows of 32 values (zero past r, and past M to a whole block of 32 rows), made here,
       and its pairs, each panel's (ADAPTER_K / 2 lines of its width, together) by the thread that multiplies it */
    uint16_t* xa32 = xa ? calloc((size_t)(M + 31) / 32 * 32 * ADAPTER_K, 2) : NULL;
    uint32_t* ap = xa ? aligned_alloc(64, (size_t)(ADAPTER_K / 2) * N * 4) : NULL;
    if (xa && (!xa32 || !ap)) {
        free(xa32); free(ap);
        return 1;
    }
    if (xa) for (int64_t i = 0; i < M; i++) memcpy(xa32 + i * ADAPTER_K, xa + i * r, (size_t)r * 2);
    int bad_any = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1) reduction(|:bad_any)
    {
#ifdef _OPENMP
        uint8_t* mine = scratch + (size_t)omp_get_thread_num() * SCRATCH_BYTES;
#else
        uint8_t* mine = scratch;
#endif
        uint32_t* panel = (uint32_t*)mine;
        float* sums = (float*)(mine + KC * NP * 2);
        float* share = (float*)mine;  /* the adapter's share, over the panel once its k chunks are done */
        const __m512 table = _mm512_loadu_ps(table16), sc = _mm512_set1_ps(ascale);
        const __m512i expo = _mm512_set1_epi16(0x7F80);
        #pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            const int64_t n0 = pn * NP, nw = n0 + NP <= N ? NP : N - n0;
            uint32_t* ap_panel = xa ? ap + n0 * (ADAPTER_K / 2) : NULL;
            if (xa) adapter_pairs(Wa, N, r, transposed, n0, nw, ap_panel);
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                const int64_t mh = m0 + MB <= M ? MB : M - m0, whole = mh / 32 * 32;  /* (a tail: the last block's) */
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t k1 = k0 + KC <= K ? k0 + KC : K;
                    const uint16_t* b = (const uint16_t*)panel;
                    if (unpack) unpack_panel(codes, scales, bs, table, rows, cols, transposed, k0, k1, n0, nw, panel);
                    if (whole) brgemm(whole, nw, k1 - k0, lda, nw, nw, k0 > 0, A + m0 * lda + k0, b, sums, true);
                    if (mh > whole) brgemm(32, nw, k1 - k0, K, nw, nw, k0 > 0, pad + k0, b, sums + whole * nw, true);
                }
                if (xa)  /* summed apart, from 0, over the adapter's 32 values (r, then zeros) */
                    brgemm((mh + 31) / 32 * 32, nw, ADAPTER_K, ADAPTER_K, nw, nw, false, xa32 + m0 * ADAPTER_K,
                           (const uint16_t*)ap_panel, share, true);
                __mmask32 bad = 0;
                for (int64_t i = 0; i < mh; i++)
                    for (int64_t j = 0; j < nw; j += 32) {
                        __m512 l = _mm512_loadu_ps(sums + i * nw + j), h = _mm512_loadu_ps(sums + i * nw + j + 16);
                        if (bias) {
                            const __m256i* b = (const __m256i*)(bias + n0 + j);
                            l = _mm512_add_ps(l, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(b)));
                            h = _mm512_add_ps(h, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(b + 1)));
                        }
                        if (xa) {  /* (sum + bias) + ascale·share, in that order, as nf4_amx adds it */
                            l = _mm512_add_ps(l, _mm512_mul_ps(sc, _mm512_loadu_ps(share + i * nw + j)));
                            h = _mm512_add_ps(h, _mm512_mul_ps(sc, _mm512_loadu_ps(share + i * nw + j + 16)));
                        }
                        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(h, l);
                        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, expo), expo);
                        _mm512_storeu_si512((void*)(C + (m0 + i) * ldc + n0 + j), v);
                    }
                bad_any |= bad != 0;
            }
        }
        release(true);  /* the tiles released, and PyTorch told so (the next brgemm configures them again) */
    }
    free(xa32); free(ap);
    *nonfinite = bad_any;
#endif
    return 0;
}
"""


class _Scratch(threading.local):
    """Each Python thread's buffers for the C's threads, and the rows padded for the last 32 (zeros at first: what
    the floor's replay multiplies)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def get(self, threads: int, k: int) -> Tensor:
        need = scratch_bytes(threads, k)
        if self.buffer.numel() < need:
            self.buffer = torch.zeros(need, dtype=torch.uint8)
        offset = -self.buffer.data_ptr() % 64  # 64-byte aligned for the C
        return self.buffer[offset:]


class NF4Brgemm:
    """The compiled product; each call one pass of C, on PyTorch's OpenMP team where built with OpenMP."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._product = lib.nf4bg_product
        self._product.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i32, i64, ptr, ptr, i64, ptr,
                                  ctypes.c_float, ptr, i64, ptr, i32, ptr, i32, ptr, ptr]
        self._product.restype = i32
        self._openmp = bool(lib.mk_openmp())
        self._table = nf4_code_table("cpu").float().contiguous()  # (16,) the NF4 code values
        self._scratch = _Scratch()

    def _threads(self, macs: int, panels: int) -> int:
        """Threads for a product of `macs` multiply-adds over `panels` panels."""
        if not self._openmp or macs < 2 * MIN_MACS_PER_THREAD:
            return 1
        return max(1, min(nf4_matmul.team_threads(), macs // MIN_MACS_PER_THREAD, panels))

    def product(self, a: Tensor, packed: Tensor, absmax: Tensor, blocksize: int, shape: tuple[int, int],
                bias: Tensor | None = None, transposed: bool = True,
                adapter: tuple[Tensor, Tensor, float] | None = None, unpack: bool = True) -> tuple[Tensor, bool]:
        """(c, finite): a·Wᵀ (+ bias) (transposed: a (M, in), the forward) or a·W (a (M, out), the input's
        gradient) -> bf16; W (out, in) NF4: packed codes (out·in / 2 bytes) and fp32 absmax per block. With
        adapter = (xa, wa, scale) (``nf4_amx.adapter_fits``), a LoRA adapter's share scale·xa·wa summed apart and
        added before the one rounding, as ``nf4_amx`` adds it (the forward: xa = x·Aᵀ, wa = B (out, r); the input's
        gradient: xa = grad_a, wa = A (r, in)). finite: every value written finite. unpack=False: the products
        alone, on whatever the threads' buffers hold (the result is not a·W: the bench's floor times them so)."""
        found = onednn_brgemm.brgemm_bf16()
        if found is None:
            raise RuntimeError("miniquant.nf4_brgemm: PyTorch's bf16 brgemm is not available now (oneDNN switched "
                               "off, or a PyTorch or CPU without it): ask fits() first")
        brgemm, release = found
        rows, cols = shape
        m, k = a.shape
        n = rows if transposed else cols
        c = torch.empty(m, n, dtype=torch.bfloat16)
        if m == 0:
            return c, True
        threads = self._threads(m * n * k, -(-n // NP))
        nonfinite = ctypes.c_int(0)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        xa, wa, scale = adapter if adapter is not None else (None, None, 1.0)
        rc = self._product(a.data_ptr(), a.stride(0), packed.data_ptr(), absmax.data_ptr(), blocksize,
                           self._table.data_ptr(), rows, cols, int(transposed), m, ptr(bias), ptr(xa),
                           0 if xa is None else xa.shape[1], ptr(wa), scale, c.data_ptr(), n,
                           self._scratch.get(threads, k).data_ptr(), int(unpack), ctypes.byref(nonfinite), threads,
                           brgemm, release)
        if rc:
            raise MemoryError("miniquant.nf4_brgemm: out of memory for the adapter's input and pairs")
        return c, not nonfinite.value


_FAMILY = KernelFamily("nf4_brgemm", _SOURCE, CFLAGS, "miniquant's NF4 products on oneDNN's brgemm", NF4Brgemm,
                       vectorized="nf4bg_built", parallel=True)


def kernels() -> NF4Brgemm | None:
    """The kernel, built on first use; None where native kernels are off (MINIQUANT_NATIVE=0), cannot be built, or
    were built without AVX512-BF16 (``nf4bg_built``)."""
    return _FAMILY.kernels()


def usable() -> bool:
    """Whether the products run here: ``nf4_amx``'s (AMX, Linux's permission), PyTorch's brgemm found, and built."""
    return nf4_amx.usable() and onednn_brgemm.brgemm_bf16() is not None and kernels() is not None


shape_fits = nf4_amx.shape_fits  # the same shapes: in and out multiples of 32, blocks a multiple of 32 values


def weight_fits(in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether layers take these products for an (out, in) NF4 weight: more values than ``nf4_amx`` takes, and a
    fitting shape."""
    return in_features * out_features > nf4_amx.MAX_WEIGHT and shape_fits(in_features, out_features, blocksize)


def fits(a: Tensor, in_features: int, out_features: int, blocksize: int) -> bool:
    """Whether layers take ``product`` for `a` (x for the forward, g for the input's gradient) with this weight: bf16
    on CPU, 2-D with contiguous rows, at most MB rows (more unpack W once per MB: there dequantizing it once into
    the workspace for oneDNN is as fast or faster, see the module docstring), the weight fitting (``weight_fits``),
    the products usable here."""
    return (a.dtype == torch.bfloat16 and a.device.type == "cpu" and a.dim() == 2 and a.stride(1) == 1
            and a.shape[0] <= MB and weight_fits(in_features, out_features, blocksize) and usable())


def takes_bf16_run() -> bool:
    """Whether a bf16 CPU run's products of fitting NF4 weights run here (what minituner.planner counts)."""
    return usable()


def scratch_bytes(threads: int, k: int) -> int:
    """Bytes held from call to call for `threads` of the C's threads (each its panel's chunk and fp32 sums) and
    products over k values (the last rows padded to 32), plus 64 for alignment. (PyTorch's compiled brgemm
    kernels, about 190 KiB a shape per thread, a few shapes a model, are not counted.)"""
    return threads * SCRATCH_BYTES + 32 * k * 2 + 64

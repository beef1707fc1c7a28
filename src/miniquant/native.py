"""Native NF4 kernels: a small C file compiled on first use with the system C compiler, called via ctypes.

Each kernel works on whole blocks in one pass: quantization reads w once and writes the packed bytes and
the absmax (no temporaries); dequantization writes its output once. The arithmetic is the eager path's
(see nf4.py), so the bytes are the same: the absmax is the largest |value| (taken as the largest bit
pattern with the sign cleared, which orders non-negative floats exactly as their values and puts Inf and
NaN above every finite value), the scaled value is value x (1 / max(absmax, 1e-38)) clamped to [-1, 1],
and the code is the number of the 15 midpoints strictly below it. Dequantization is code value x scale
in float32, then a round-to-nearest-even cast. No fast-math flags: float results are IEEE-exact.

The source has three paths, and -march=native builds the widest the CPU has (``NativeKernels.path``):
AVX-512 (16 values a vector; the code by a 4-step binary search with in-register permutes; dequantizing to bf16
or fp16 with AVX-512 BW, each block's 16 products code x scale are rounded once and its nibbles look the results
up, 32 values a vpermw: 0.035 against 0.058 ms for a 2048 x 512 weight, AMD EPYC, 2 cores), AVX2 with F16C
(8 a vector, 32 per step; the code by 15 compares, and the 16-entry code table as two 8-entry permutes),
and plain C for other CPUs and for block sizes the vector loops do not divide. All give the same bytes;
tests/miniquant/test_nf4_native.py builds each one this CPU can run and checks it against the eager path.

Building, caching (under $MINIQUANT_CACHE, keyed by the source, the flags, the compiler and the CPU's feature
flags: it is built with -march=native) and the threads are ``minikernels.build``'s.
Quantization splits its blocks across `torch.get_num_threads()` threads (PyTorch's OpenMP team where the library
has OpenMP, see minikernels.build; else Python threads: ctypes releases the GIL during a call), and so does
dequantization into an existing buffer (the layers' shared workspace); dequantization into a fresh tensor splits
only on OpenMP's threads, and runs on the calling thread otherwise.
`kernels()` returns None when there is no compiler, the build fails, or MINIQUANT_NATIVE=0: the callers
then use the eager PyTorch path, which gives the same bytes.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from minikernels.build import (CACHE_ENV, OPENMP_PRELUDE, KernelFamily, ThreadSplit, build_library,  # noqa: F401
                                fresh_tensor, parallel_entry)  # (CACHE_ENV: bench_nf4)

MIN_VALUES_PER_THREAD = 1 << 21  # smaller calls stay on the calling thread (handing work over costs ~50 µs)
MIN_VALUES_PER_THREAD_WARM = 1 << 18  # the same, dequantizing into an existing (already touched) buffer
CHUNK_VALUES = 1 << 18  # threads take work in chunks of this many values, as they get free
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
# dtype codes shared with the C source
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _float32_contiguous(t: Tensor) -> Tensor:
    """t itself when it is already contiguous float32 (no op called), else a contiguous float32 copy."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.contiguous().float()

_SOURCE = OPENMP_PRELUDE + r"""
#include <stdint.h>
#include <math.h>
#include <string.h>
/* one vector path, the widest this CPU has (built with -march=native); plain C for the rest */
#if defined(__AVX512F__)
#define NF4_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__)
#define NF4_AVX2 1
#include <immintrin.h>
#endif

#define MAX_BLOCK 4096
#if defined(__FLT16_MAX__)
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

int nf4_has_f16(void) { return HAVE_F16; }  /* float16 needs _Float16 for the block sizes plain C runs */

/* values per vector of the path built: 16 (AVX-512), 8 (AVX2) or 1 (plain C) */
int nf4_lanes(void) {
#if defined(NF4_AVX512)
    return 16;
#elif defined(NF4_AVX2)
    return 8;
#else
    return 1;
#endif
}

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (PyTorch's rule) */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u = bits_from_f32(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* x[first : first + n] (dtype 0 float32, 1 bfloat16, 2 float16) as float32 in buf; exact */
static void load_block(const void* x, int dtype, int64_t first, int64_t n, float* buf) {
    if (dtype == F32) {
        memcpy(buf, (const float*)x + first, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t* h = (const uint16_t*)x + first;
        for (int64_t i = 0; i < n; i++) buf[i] = f32_from_bits((uint32_t)h[i] << 16);
    } else {
#if HAVE_F16
        const _Float16* h = (const _Float16*)x + first;
        for (int64_t i = 0; i < n; i++) buf[i] = (float)h[i];
#endif
    }
}

/* buf[0 : n] cast to dtype into out[first : first + n], round to nearest even */
static void store_block(const float* buf, int64_t n, void* out, int dtype, int64_t first) {
    if (dtype == F32) {
        memcpy((float*)out + first, buf, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        uint16_t* h = (uint16_t*)out + first;
        for (int64_t i = 0; i < n; i++) h[i] = bf16_from_f32(buf[i]);
    } else {
#if HAVE_F16
        _Float16* h = (_Float16*)out + first;
        for (int64_t i = 0; i < n; i++) h[i] = (_Float16)buf[i];
#endif
    }
}

/* ---- portable C: one block (loops the compiler vectorizes) -------------------------------------- */

static void quantize_block_c(const void* x, int dtype, int64_t first, int64_t bs, const float* mids,
                             uint8_t* packed, float* absmax) {
    float v[MAX_BLOCK];
    uint8_t codes[MAX_BLOCK];
    load_block(x, dtype, first, bs, v);
    uint32_t m = 0;  /* the largest |value| as a bit pattern: orders like the value, Inf and NaN above all */
    for (int64_t i = 0; i < bs; i++) {
        uint32_t u = bits_from_f32(v[i]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    float a = f32_from_bits(m);
    *absmax = a;
    float inv = 1.0f / (a > 1e-38f ? a : 1e-38f);  /* NaN absmax: the caller raises */
    for (int64_t i = 0; i < bs; i++) {
        float s = v[i] * inv;
        s = s < -1.0f ? -1.0f : s;
        s = s > 1.0f ? 1.0f : s;
        int32_t c = 0;
        for (int k = 0; k < 15; k++) c += s > mids[k];  /* midpoints strictly below s */
        codes[i] = (uint8_t)c;
    }
    for (int64_t i = 0; i < bs / 2; i++) packed[i] = (uint8_t)((codes[2 * i] << 4) | codes[2 * i + 1]);
}

static void dequantize_block_c(const uint8_t* p, float s, int64_t bs, const float* code, void* out, int dtype,
                               int64_t first) {
    float v[MAX_BLOCK];
    for (int64_t i = 0; i < bs / 2; i++) {
        v[2 * i] = code[p[i] >> 4] * s;
        v[2 * i + 1] = code[p[i] & 15] * s;
    }
    store_block(v, bs, out, dtype, first);
}

/* ---- AVX-512: 16 values at a time (block sizes that are multiples of 16) ------------------------- */
#ifdef NF4_AVX512
static inline __m512 load16(const void* x, int dtype, int64_t i) {
    if (dtype == F32) return _mm512_loadu_ps((const float*)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
    if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);  /* exact */
}

/* 16 fp32 lanes rounded to bf16 (nearest even, NaN -> 0x7FC0, as PyTorch) or fp16 */
static inline __m256i round16(int dtype, __m512 v) {
    if (dtype == BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
        return _mm512_cvtepi32_epi16(r);
    }
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline void store16(void* out, int dtype, int64_t i, __m512 v) {
    if (dtype == F32) {
        _mm512_storeu_ps((float*)out + i, v);
        return;
    }
    _mm256_storeu_si256((__m256i*)((uint16_t*)out + i), round16(dtype, v));
}

static inline __attribute__((always_inline)) void quantize_block_avx512(const void* x, int dtype, int64_t first, int64_t bs, __m512 mids,
                                  uint8_t* packed, float* absmax) {
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < bs; i += 16)
        m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(load16(x, dtype, first + i)), _mm512_set1_epi32(0x7FFFFFFF)));
    float a = f32_from_bits(_mm512_reduce_max_epu32(m));
    *absmax = a;
    const __m512 inv = _mm512_set1_ps(1.0f / (a > 1e-38f ? a : 1e-38f));
    const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < bs; i += 16) {
        __m512 s = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(load16(x, dtype, first + i), inv), lo), hi);
        /* branch-free binary search over the 15 sorted midpoints (a 16th, +Inf, is never below s):
           c = number of midpoints strictly below s */
        __m512i c = _mm512_setzero_si512();
        for (int step = 8; step >= 1; step >>= 1) {
            __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(c, _mm512_set1_epi32(step - 1)), mids);
            c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(t, s, _CMP_LT_OQ), c, _mm512_set1_epi32(step));
        }
        /* 64-bit lane k holds codes 2k (low half) and 2k+1 (high half): byte = code_2k << 4 | code_2k+1 */
        __m512i pairs = _mm512_or_si512(_mm512_slli_epi64(_mm512_and_si512(c, _mm512_set1_epi64(0xFFFFFFFF)), 4),
                                        _mm512_srli_epi64(c, 32));
        _mm_storel_epi64((__m128i*)(packed + i / 2), _mm512_cvtepi64_epi8(pairs));
    }
}

static inline __attribute__((always_inline)) void dequantize_block_avx512(const uint8_t* p, float s, int64_t bs, __m512 table, void* out, int dtype,
                                    int64_t first, int stream) {
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    int64_t i = 0;
    for (; i + 16 <= bs / 2; i += 16) {  /* 16 bytes -> 32 values */
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + i)));
        __m512 high = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), sv);
        __m512 low = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), table), sv);
        const __m512 v0 = _mm512_permutex2var_ps(high, even, low), v1 = _mm512_permutex2var_ps(high, odd, low);
        if (stream) {  /* float32 out: whole cache lines (see nf4_dequantize) */
            _mm512_stream_ps((float*)out + first + 2 * i, v0);
            _mm512_stream_ps((float*)out + first + 2 * i + 16, v1);
        } else {
            store16(out, dtype, first + 2 * i, v0);
            store16(out, dtype, first + 2 * i + 16, v1);
        }
    }
    if (i < bs / 2) {  /* 8 bytes left (a block of 16 or 48 values) */
        float code[16], v[16];
        _mm512_storeu_ps(code, table);
        for (int64_t j = 0; j < bs / 2 - i; j++) {
            v[2 * j] = code[p[i + j] >> 4] * s;
            v[2 * j + 1] = code[p[i + j] & 15] * s;
        }
        store_block(v, bs - 2 * i, out, dtype, first + 2 * i);
    }
}
#endif

#if defined(NF4_AVX512) && defined(__AVX512BW__)
/* bf16 or fp16 out: each value of a block is one of its 16 products code[j] * s, rounded as store16 rounds it, so
   the block's 16 are rounded once and its nibbles look them up, 32 values a lookup (vpermw): the same bits as
   rounding each value, in a third of the instructions */
static inline __attribute__((always_inline)) void dequantize_block_16bit(const uint8_t* p, float s, int64_t bs,
                                                                         __m512 table, void* out, int dtype,
                                                                         int64_t first, int stream) {
    __m256i rounded = round16(dtype, _mm512_mul_ps(table, _mm512_set1_ps(s)));
    const __m512i lut = _mm512_castsi256_si512(rounded);  /* 16-bit lanes 0..15: the nibbles index no further */
    uint16_t* o = (uint16_t*)out + first;
    int64_t i = 0;
    for (; i + 16 <= bs / 2; i += 16) {  /* 16 bytes -> 32 values: 32-bit lane k = (low nibble << 16) | high nibble */
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + i)));
        __m512i idx = _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), 16));
        const __m512i v = _mm512_permutexvar_epi16(idx, lut);
        if (stream) _mm512_stream_si512((void*)(o + 2 * i), v);  /* a whole cache line (see nf4_dequantize) */
        else _mm512_storeu_si512((void*)(o + 2 * i), v);
    }
    if (i < bs / 2) {  /* 8 bytes left (a block of 16 or 48 values) */
        uint16_t v[16];
        _mm256_storeu_si256((__m256i*)v, rounded);
        for (int64_t j = i; j < bs / 2; j++) {
            o[2 * j] = v[p[j] >> 4];
            o[2 * j + 1] = v[p[j] & 15];
        }
    }
}
#endif

/* ---- AVX2 (with F16C): 8 values at a time, 32 per step (block sizes that are multiples of 32) ---- */
#ifdef NF4_AVX2
static inline __m256 load8(const void* x, int dtype, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps((const float*)x + i);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
    if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);  /* exact */
}

static inline void store8(void* out, int dtype, int64_t i, __m256 v) {
    if (dtype == F32) {
        _mm256_storeu_ps((float*)out + i, v);
        return;
    }
    __m128i h;
    if (dtype == BF16) {  /* round to nearest even, NaN -> 0x7FC0, as PyTorch */
        __m256i u = _mm256_castps_si256(v);
        __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        __m256i packed = _mm256_packus_epi32(r, r);  /* per 128-bit lane: 4 values, twice */
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  /* lanes' first halves together */
    } else {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128((__m128i*)((uint16_t*)out + i), h);
}

/* the code of 8 scaled values: the number of the 15 midpoints strictly below each (15 compares) */
static inline __m256i codes8(__m256 s, const __m256* mids) {
    __m256i c = _mm256_setzero_si256();
    for (int k = 0; k < 15; k++)  /* a true compare is all ones (-1): subtracting it counts it */
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(s, mids[k], _CMP_GT_OQ)));
    return c;
}

static inline __attribute__((always_inline)) void quantize_block_avx2(const void* x, int dtype, int64_t first, int64_t bs,
                                                                       const __m256* mids, uint8_t* packed, float* absmax) {
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = 0; i < bs; i += 8)
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(load8(x, dtype, first + i)), _mm256_set1_epi32(0x7FFFFFFF)));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
    float a = f32_from_bits((uint32_t)_mm_cvtsi128_si32(m4));
    *absmax = a;
    const __m256 inv = _mm256_set1_ps(1.0f / (a > 1e-38f ? a : 1e-38f));
    const __m256 lo = _mm256_set1_ps(-1.0f), hi = _mm256_set1_ps(1.0f);
    const __m256i pair_weights = _mm256_set1_epi16(0x0110);  /* bytes 16, 1: code_2k * 16 + code_2k+1 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < bs; i += 32) {
        __m256i c[4];
        for (int j = 0; j < 4; j++) {
            __m256 s = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(load8(x, dtype, first + i + 8 * j), inv), lo), hi);
            c[j] = codes8(s, mids);
        }
        /* 32 codes (0..15) -> 32 bytes in order: the packs interleave 128-bit lanes, the permute undoes it */
        __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, order);
        __m256i nibbles = _mm256_maddubs_epi16(bytes, pair_weights);  /* 16 bytes' worth, one per 16-bit lane */
        __m256i out = _mm256_permute4x64_epi64(_mm256_packus_epi16(nibbles, nibbles), 0x08);
        _mm_storeu_si128((__m128i*)(packed + i / 2), _mm256_castsi256_si128(out));
    }
}

/* table[idx] for 8 indices 0..15: two 8-entry lookups, the second where idx > 7 */
static inline __m256 lookup16(__m256 lo, __m256 hi, __m256i idx) {
    __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), upper);
}

static inline __attribute__((always_inline)) void dequantize_block_avx2(const uint8_t* p, float s, int64_t bs, __m256 lo,
                                                                         __m256 hi, void* out, int dtype, int64_t first) {
    const __m256 sv = _mm256_set1_ps(s);
    for (int64_t i = 0; i < bs / 2; i += 8) {  /* 8 bytes -> 16 values */
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + i)));
        __m256 high = _mm256_mul_ps(lookup16(lo, hi, _mm256_srli_epi32(bytes, 4)), sv);
        __m256 low = _mm256_mul_ps(lookup16(lo, hi, _mm256_and_si256(bytes, _mm256_set1_epi32(15))), sv);
        __m256 a = _mm256_unpacklo_ps(high, low), b = _mm256_unpackhi_ps(high, low);  /* h0 l0 h1 l1 | h4 l4 h5 l5 */
        store8(out, dtype, first + 2 * i, _mm256_permute2f128_ps(a, b, 0x20));
        store8(out, dtype, first + 2 * i + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}
#endif

/* blocks [b0, b1) of x (dtype 0 float32, 1 bfloat16, 2 float16) -> packed codes and absmax */
void nf4_quantize(const void* x, int dtype, int64_t b0, int64_t b1, int64_t bs, const float* mids,
                  uint8_t* packed, float* absmax) {
#ifdef NF4_AVX512
    if (bs % 16 == 0) {
        float m16[16];
        memcpy(m16, mids, 15 * sizeof(float));
        m16[15] = __builtin_inff();
        const __m512 mv = _mm512_loadu_ps(m16);
        if (bs == 64)  /* QLoRA's block size: a constant unrolls the block, so its vectors overlap */
            for (int64_t b = b0; b < b1; b++) quantize_block_avx512(x, dtype, b * 64, 64, mv, packed + b * 32, absmax + b);
        else
            for (int64_t b = b0; b < b1; b++) quantize_block_avx512(x, dtype, b * bs, bs, mv, packed + b * (bs / 2), absmax + b);
        return;
    }
#endif
#ifdef NF4_AVX2
    if (bs % 32 == 0) {
        __m256 mv[15];
        for (int k = 0; k < 15; k++) mv[k] = _mm256_set1_ps(mids[k]);
        if (bs == 64)
            for (int64_t b = b0; b < b1; b++) quantize_block_avx2(x, dtype, b * 64, 64, mv, packed + b * 32, absmax + b);
        else
            for (int64_t b = b0; b < b1; b++) quantize_block_avx2(x, dtype, b * bs, bs, mv, packed + b * (bs / 2), absmax + b);
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) quantize_block_c(x, dtype, b * bs, bs, mids, packed + b * (bs / 2), absmax + b);
}

/* blocks [b0, b1): out = code[nibble] * scales[block] in float32, then cast to dtype.
   stream: the AVX-512 paths write with non-temporal stores where each 64-byte store is a whole cache line (out
   64-byte aligned; bf16 and fp16 in blocks of a multiple of 32 values); a hint, ignored elsewhere. For a
   destination that other cores' caches hold (see NativeKernels.dequantize), which a normal store would first have
   to take from them. */
void nf4_dequantize(const uint8_t* packed, const float* scales, int64_t b0, int64_t b1, int64_t bs,
                    const float* code, void* out, int dtype, int stream) {
#ifdef NF4_AVX512
    if (bs % 16 == 0) {
        const __m512 table = _mm512_loadu_ps(code);
        const int aligned = stream && ((uintptr_t)out & 63) == 0;
#ifdef __AVX512BW__
        if (dtype != F32) {
            const int nt = aligned && bs % 32 == 0;
            if (bs == 64)
                for (int64_t b = b0; b < b1; b++)
                    dequantize_block_16bit(packed + b * 32, scales[b], 64, table, out, dtype, b * 64, nt);
            else
                for (int64_t b = b0; b < b1; b++)
                    dequantize_block_16bit(packed + b * (bs / 2), scales[b], bs, table, out, dtype, b * bs, nt);
            if (nt) _mm_sfence();  /* the streamed lines visible to every core before this call returns */
            return;
        }
#endif
        const int nt = aligned && dtype == F32;  /* (a 16-bit out here stores 32 bytes at a time: not streamed) */
        if (bs == 64)
            for (int64_t b = b0; b < b1; b++)
                dequantize_block_avx512(packed + b * 32, scales[b], 64, table, out, dtype, b * 64, nt);
        else
            for (int64_t b = b0; b < b1; b++)
                dequantize_block_avx512(packed + b * (bs / 2), scales[b], bs, table, out, dtype, b * bs, nt);
        if (nt) _mm_sfence();
        return;
    }
#endif
#ifdef NF4_AVX2
    if (bs % 16 == 0) {
        const __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8);
        if (bs == 64)
            for (int64_t b = b0; b < b1; b++) dequantize_block_avx2(packed + b * 32, scales[b], 64, lo, hi, out, dtype, b * 64);
        else
            for (int64_t b = b0; b < b1; b++) dequantize_block_avx2(packed + b * (bs / 2), scales[b], bs, lo, hi, out, dtype, b * bs);
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) dequantize_block_c(packed + b * (bs / 2), scales[b], bs, code, out, dtype, b * bs);
}

/* 1 when every scale s has |s| <= limit (so is finite: NaN fails the comparison), else 0; one vectorized pass */
int nf4_scales_within(const float* scales, int64_t n, float limit) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= fabsf(scales[i]) <= limit;
    return ok;
}

/* the two above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void nf4_quantize_parallel(const void* x, int dtype, int64_t b0, int64_t b1, int64_t bs, const float* mids,
                           uint8_t* packed, float* absmax, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, nf4_quantize(x, dtype, r0, r1, bs, mids, packed, absmax));
}

void nf4_dequantize_parallel(const uint8_t* packed, const float* scales, int64_t b0, int64_t b1, int64_t bs,
                             const float* code, void* out, int dtype, int stream, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, nf4_dequantize(packed, scales, r0, r1, bs, code, out, dtype, stream));
}
"""


def _build(compiler: str) -> Path:
    return build_library("nf4", _SOURCE, CFLAGS, compiler)


class NativeKernels:
    """The compiled NF4 kernels, with the block range split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._quantize = lib.nf4_quantize
        self._quantize.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ptr]
        self._quantize.restype = None
        self._dequantize = lib.nf4_dequantize
        self._dequantize.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._dequantize.restype = None
        self._scales_within = lib.nf4_scales_within
        self._scales_within.argtypes = [ptr, i64, ctypes.c_float]
        self._scales_within.restype = ctypes.c_int
        self._quantize_parallel = parallel_entry(lib, self._quantize)  # over OpenMP's threads
        self._dequantize_parallel = parallel_entry(lib, self._dequantize)  # over OpenMP's threads
        self.dtypes = tuple(d for d, c in _DTYPE_CODE.items() if c != 2 or lib.nf4_has_f16())
        self.path = {16: "AVX-512", 8: "AVX2"}.get(lib.nf4_lanes(), "plain C")  # the vector path this CPU runs
        self.openmp = bool(lib.mk_openmp())  # built with OpenMP: the threads are PyTorch's team (minikernels.build)
        self._threads = ThreadSplit("miniquant", openmp=self.openmp)

    def _split(self, blocks: int, blocksize: int, call, parallel, min_values: int | None = None) -> None:
        """call(b0, b1) over [0, blocks) on threads, each at least `min_values` values (default
        MIN_VALUES_PER_THREAD); parallel(b0, b1, chunks, threads) is its OpenMP entry point."""
        self._threads.run(blocks, blocksize, call, min_values or MIN_VALUES_PER_THREAD, CHUNK_VALUES, parallel)

    def quantize(self, x: Tensor, mids: Tensor) -> tuple[Tensor, Tensor]:
        """(blocks, blocksize) contiguous CPU tensor -> ((blocks, blocksize/2) uint8, (blocks,) float32 absmax)."""
        blocks, bs = x.shape
        x, mids = x.contiguous(), mids.contiguous().float()
        packed = fresh_tensor((blocks, bs // 2), torch.uint8)
        absmax = torch.empty(blocks, dtype=torch.float32)
        args = (x.data_ptr(), _DTYPE_CODE[x.dtype])
        tail = (bs, mids.data_ptr(), packed.data_ptr(), absmax.data_ptr())
        self._split(blocks, bs, lambda b0, b1: self._quantize(*args, b0, b1, *tail),
                    lambda b0, b1, chunks, threads: self._quantize_parallel(*args, b0, b1, *tail, chunks, threads))
        return packed, absmax

    def scales_within(self, scales: Tensor, limit: float) -> bool:
        """Whether every value of a contiguous float32 CPU tensor has |value| <= limit (NaN has not); limit a finite
        float32 value."""
        if not abs(limit) <= _FLOAT32_MAX:
            raise ValueError(f"limit must be a finite float32 value, got {limit}")
        if scales.dtype != torch.float32 or not scales.is_contiguous() or not scales.is_cpu:
            raise ValueError(f"scales must be a contiguous float32 CPU tensor, got {scales.dtype} on {scales.device}")
        return bool(self._scales_within(scales.data_ptr(), scales.numel(), limit))

    def dequantize(self, packed: Tensor, scales: Tensor, code: Tensor, dtype: torch.dtype,
                   out: Tensor | None = None, stream: bool = False) -> Tensor:
        """(blocks, blocksize/2) uint8, (blocks,) float32 scales -> (blocks, blocksize) dtype.

        With `out` (a contiguous CPU tensor of that shape and dtype) the values are written into it: no
        allocation and, once it has been written before, no page faults.
        stream: write with non-temporal stores (on the AVX-512 paths, where out is 64-byte aligned and, for bf16
        and fp16, the blocks hold a multiple of 32 values; the same values either way), for an `out` that other
        cores' caches hold: the layers' shared workspace, which each product reads on every thread of PyTorch's
        team. A normal store first takes each such line from the other cores' caches. On a 2-core AMD EPYC, a
        2 MiB write right after a 2-thread oneDNN product had read it took 82-263 µs with normal stores (three
        runs) and 49-52 µs streamed; 512 KiB took 65-67 µs against 13-15. With no product in between, 2 MiB took
        18 µs against 48: streaming bypasses this core's cache too, so it pays only for such a destination."""
        blocks, half = packed.shape
        packed, scales, code = packed.contiguous(), _float32_contiguous(scales), _float32_contiguous(code)
        fresh = out is None
        if fresh:
            out = fresh_tensor((blocks, 2 * half), dtype)
        elif out.shape != (blocks, 2 * half) or out.dtype != dtype or not out.is_contiguous() or not out.is_cpu:
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of shape {(blocks, 2 * half)}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        head = (packed.data_ptr(), scales.data_ptr())
        tail = (2 * half, code.data_ptr(), out.data_ptr(), _DTYPE_CODE[dtype], int(stream))
        if not fresh and self._threads.threads(blocks * 2 * half, MIN_VALUES_PER_THREAD_WARM) <= 1:  # one thread's
            self._dequantize(*head, 0, blocks, *tail)  # share, called at once: the QLoRA step's transient weights
            return out  # of fewer values, twice each a step, pay no more Python than this
        call = lambda b0, b1: self._dequantize(*head, b0, b1, *tail)  # noqa: E731
        parallel = lambda b0, b1, chunks, threads: self._dequantize_parallel(*head, b0, b1, *tail, chunks, threads)  # noqa: E731
        if fresh and not self._threads.openmp:  # a fresh output is bound by its first touch (page faults): on a
            call(0, blocks)  # 2-core AMD EPYC a second Python thread made a 64 MiB one slower
        else:  # an existing buffer (the layers' shared workspace) from 512 K values; a fresh one from 4 M on
            # PyTorch's OpenMP team (4096² on an AMX Xeon: fp32 12.0 -> 9.2 ms, bf16 8.0 -> 5.6 ms)
            self._split(blocks, 2 * half, call, parallel, None if fresh else MIN_VALUES_PER_THREAD_WARM)
        return out


_FAMILY = KernelFamily("nf4", _SOURCE, CFLAGS, "miniquant's native NF4 kernels", NativeKernels, parallel=True)


def kernels() -> NativeKernels | None:
    """The native kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0) or unavailable."""
    return _FAMILY.kernels()

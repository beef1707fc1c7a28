"""C helpers shared by the bf16 kernels: bf16 <-> fp32 conversions and exp(x) for x <= 0, scalar and 16 lanes.

    SOURCE = BF16_EXP_C + my_kernels   # prepended to a kernel family's C source (minikernels.build)

exp is computed as Cephes' expf does (x = n·ln2 + r with |r| <= ln2/2, a degree-7 polynomial in r, times
2^n, its multiply-adds fused), to about 1 unit in the last place of fp32, on AVX-512 16 values at a time
(``exp16``) and in plain C (``exp_nonpos``, its fused multiply-adds written as fmaf) with the same operations:
built with -ffp-contract=off (the compiler fuses nothing of its own), both give the same bits. Fused, exp16 is
13 vector operations instead of 21 (single-threaded, the attention softmax's recomputation took 23% less time).
Inputs below -87.34 give 0 (fp32 denormals are not produced). bf16 is rounded to nearest even, NaN to 0x7FC0
(PyTorch's rule): ``store16`` writes 16 lanes so (on a CPU with AVX512-BF16 by one vcvtneps2bf16 where no lane is
a NaN or a denormal, the same bits: ``minigpt.native_loss``'s gradient of Llama-shaped logits, 512 x 128,256,
took 16.4 ms against 17.4 with the integer rounding for every store; 2 threads, Intel Xeon with AMX, 2026-12-06,
medians of 41 interleaved calls, the same bits checked), ``round16`` keeps the rounded value in fp32 lanes.
``TAIL16`` sends a kernel's last n < 16 values through the same 16-lane code (a zero-padded copy), so a value's
bits do not depend on where it sits or how the threads split the tensor. Used by minigpt's bf16 kernels (the loss,
attention, norms, activations and RoPE), ``miniquant.nf4_matmul`` and, for its bf16 conversions,
``minituner.native_lora``.

``BF16_SIGMOID_C`` (after BF16_EXP_C) adds σ(x) on 16 lanes (a shorter exp with fused multiply-adds, about 2e-6
relative, ample for a bf16 result), for the activation kernels, ``minigpt.native_swiglu`` and
``minigpt.native_gelu``.
"""

BF16_EXP_C = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float f32_from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* float -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (PyTorch's rule) */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define EXP_LO -87.33654f           /* below: exp is 0 here (fp32 denormals are not produced) */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

/* exp(x) for finite x <= 0 (Cephes expf); 0 below EXP_LO */
static inline float exp_nonpos(float x) {
    if (x < EXP_LO) return 0.0f;
    float t = fmaf(x, LOG2E, -0.5f);
    int n = (int)t;                       /* truncation of t - 0.5 rounds t <= 0 to the nearest integer */
    float fn = (float)n;
    float r = fmaf(-fn, LN2_HI, x);
    r = fmaf(-fn, LN2_LO, r);
    float p = P0;
    p = fmaf(p, r, P1); p = fmaf(p, r, P2); p = fmaf(p, r, P3); p = fmaf(p, r, P4); p = fmaf(p, r, P5);
    p = fmaf(p, r * r, r);
    p = p + 1.0f;
    uint32_t s = (uint32_t)(n + 127) << 23; float scale; memcpy(&scale, &s, 4);
    return p * scale;
}

#ifdef __AVX512F__
static inline __m512 load16(const uint16_t* z) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)z)), 16));
}

/* the same operations as exp_nonpos, 16 lanes */
static inline __m512 exp16(__m512 x) {
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5f));
    __m512i n = _mm512_cvttps_epi32(t);
    __m512 fn = _mm512_cvtepi32_ps(n);
    __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps(~zero, p, scale);
}

/* bf16 rounding of 16 fp32 lanes, nearest even, as PyTorch rounds (denormals kept; NaN -> 0x7FC0), the rounded
   value kept in fp32 lanes: what store16 and then load16 give */
static inline __m512 round16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb),
                                 _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                                     _mm512_set1_epi32(0x7FC00000)));
}

/* 16 fp32 lanes -> 16 bf16 (round to nearest even; NaN -> 0x7FC0, denormals kept), in integer operations */
static inline void store16_bits(uint16_t* out, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16(rounded));
}

/* the bits store16_bits writes: on a CPU with AVX512-BF16 one vcvtneps2bf16, unless a lane is a NaN or a nonzero
   denormal, which that instruction would give other bits (one vfpclassps finds those: quiet NaN 0x01, denormal
   0x20, signalling NaN 0x80; with two compares and a mask AND instead, the activation kernels took 8-14% longer) */
static inline void store16(uint16_t* out, __m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!_mm512_fpclass_ps_mask(v, 0xA1)) {
        _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    store16_bits(out, v);
}
#endif

/* name: a zero-padded block of 16 bf16 values holding the n < 16 at src (none when src is NULL), so a kernel's
   last values go through its 16-lane code too: a value gives the same bits wherever it sits in its tensor and
   however the threads split it (no scalar twin to drift one unit from the vector code) */
#define TAIL16(n, src, name) \
    uint16_t name[16] = {0}; \
    if (src) memcpy(name, (src), (size_t)(n) * 2)

"""

# σ(x) for the activation kernels (minigpt.native_swiglu, native_gelu); after BF16_EXP_C
BF16_SIGMOID_C = r"""
#ifdef __AVX512F__
/* e^x for x <= 0, 16 lanes, to about 2e-6 relative (a bf16 unit is 4e-3): x = n·ln2 + r, |r| <= ln2/2, e^r by its
   degree-5 Taylor polynomial with fused multiply-adds, times 2^n; 0 below -87 (no denormals); NaN stays NaN */
static inline __m512 exp16_short(__m512 x) {
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 120.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~zero, p, n);                       /* p · 2^n */
}

static inline __m512 sigmoid16(__m512 x) {
    __m512 a = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));   /* -|x|; NaN stays NaN */
    __m512 e = exp16_short(a);
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);                  /* in [1, 2] */
    __m512 p = _mm512_rcp14_ps(d);                                      /* 1/d to 2^-14, then one Newton step */
    p = _mm512_mul_ps(p, _mm512_fnmadd_ps(d, p, _mm512_set1_ps(2.0f)));
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(p, neg, e, p);
}

#endif

"""

"""C helpers that unpack NF4 codes into bf16 pairs, shared by the kernels that multiply an NF4 weight without
dequantizing it into the workspace first (``miniquant.nf4_matmul``, ``miniquant.nf4_amx``, ``miniquant.nf4_brgemm``).

    SOURCE = ... + NF4_UNPACK_C + my_kernels   # bf16_bits always; nf4_32, pairs16, lut16, nib32 where AVX512-BF16
                                               # (and BW, VL)

``nf4_32`` gives 32 NF4 values (16 packed bytes, element 2i in byte i's high nibble) times their block's scale in
fp32, in order; ``pairs16`` rounds two vectors to bf16 (nearest even) and interleaves them into 16 pairs, one
uint32 each; ``bf16_bits`` rounds one fp32 value as PyTorch's .to(torch.bfloat16) does (nearest even, NaN as
0x7FC0, denormals kept). code x scale in fp32, then one rounding: the values ``dequantize_nf4`` writes.
``lut16`` rounds a block's 16 values code x scale once and ``nib32`` turns 16 packed bytes into their 32 codes as
16-bit indices, so one vpermw of the two gives the same 32 bf16 values in order.
"""

NF4_UNPACK_C = r"""
#include <string.h>
static inline uint32_t bf16_bits(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
/* 32 NF4 values from 16 packed bytes times s, in order: lo = values 0..15, hi = 16..31 */
static inline void nf4_32(const uint8_t* p, float s, __m512 table, __m512* lo, __m512* hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m512 sc = _mm512_set1_ps(s);
    const __m512 ev = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc);  /* 0, 2, .., 30 */
    const __m512 od = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table), sc);
    const __m512i i0 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i i1 = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    *lo = _mm512_permutex2var_ps(ev, i0, od);
    *hi = _mm512_permutex2var_ps(ev, i1, od);
}
/* a block's 16 values code[j]·s rounded to bf16 (nearest even), in 16-bit lanes 0..15 */
static inline __m512i lut16(__m512 table, float s) {
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(table, _mm512_set1_ps(s))));
}
/* 16 packed bytes -> the 32 codes in order as 16-bit lanes (value 2i in byte i's high nibble) */
static inline __m512i nib32(const uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), 16));
}
/* 16 pairs (a[i], b[i]) as bf16 in one uint32 each (a low), rounded to nearest even */
static inline __m512i pairs16(__m512 a, __m512 b) {
    const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  /* words 0..15: a, 16..31: b */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, ab);
}
#endif
"""

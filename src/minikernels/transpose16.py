"""C helper: a 16 x 16 block of 32-bit words transposed in registers (AVX-512), for kernels that write operands
in AMX's tiles' layout or read their sums back transposed.

    SOURCE = TRANSPOSE16_C + my_kernels   # then transpose16(__m512i r[16]) where __AVX512F__

Three rounds of unpacks and 128-bit shuffles. Used by ``miniquant.nf4_amx`` and ``miniquant.nf4_brgemm`` (an NF4
weight's rows into the tiles' strips) and ``minigpt.fused_attention`` (keys as strips, blocks of q and dy
transposed, the fp32 sums of dk and dv back to rows).
"""

TRANSPOSE16_C = r"""
#ifdef __AVX512F__
#include <immintrin.h>
/* r (16 rows of 16 words) transposed in place: r[c] becomes column c */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u[4i + c], 128-bit lane L: rows 4i..4i + 3 of column 4L + c */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}
#endif
"""

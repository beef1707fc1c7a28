"""C helpers for kernels on AMX's tiles (Intel Xeon with amx_bf16), shared by the libraries that use them.

    SOURCE = AMX_TILES_C + my_kernels   # then, under #ifdef MK_AMX: mk_tile_config, mk_amx_permit(),
                                        # mk_tiles_2x2_config(), mk_tiles_2x2(...)

``MK_AMX`` is defined where the compiler targets AMX's tiles and bf16 (-march=native on such a CPU) on Linux.
``mk_tile_config`` is the 64-byte palette-1 configuration ``_tile_loadconfig`` reads. ``mk_amx_permit()`` asks
Linux once for this process's permission to use the tiles (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; the
permission is the process's, for all its threads) and returns whether it was granted. The GEMMs' 2 x 2 step:
``mk_tiles_2x2_config()`` sets eight tiles of 16 rows by 64 bytes (0-3 a 32 x 32 block of fp32 sums, 4-5 A's two
16-row tiles, 6-7 B's two 16-column strips) and ``mk_tiles_2x2`` adds a range of k to the sums. Used by
``minituner.native_lora`` (the adapters' thin products), ``miniquant.nf4_amx`` (an NF4 weight's GEMM) and
``minigpt.fused_attention`` (causal attention's products).
"""

AMX_TILES_C = r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MK_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) mk_tile_config;
static int mk_amx_permit(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
/* this thread's tiles: eight of 16 rows by 64 bytes (0-3 sums, 4-5 A's rows, 6-7 B's strips) */
static inline void mk_tiles_2x2_config(void) {
    mk_tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}
/* tiles 0-3 (a 32 x 32 block of fp32 sums: rows 0-15 and 16-31 by columns 0-15 and 16-31) += the products over k in
   [k0, k1), steps of 32: A's 32 rows of bf16 from a (lda apart; k at a + k), B's two 16-column strips b0 and b1 in
   the tiles' layout (line p the pairs of k = 2p and 2p + 1, 64 bytes apart) */
static inline void mk_tiles_2x2(const uint16_t* a, int64_t lda, const uint32_t* b0, const uint32_t* b1, int64_t k0,
                                int64_t k1) {
    for (int64_t k = k0; k < k1; k += 32) {
        _tile_loadd(4, a + k, lda * 2);
        _tile_loadd(6, b0 + k / 2 * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + k / 2 * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * lda + k, lda * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}
#endif
"""

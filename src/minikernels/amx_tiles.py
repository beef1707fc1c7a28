"""C helpers for kernels on AMX's tiles (Intel Xeon with amx_bf16), shared by the libraries that use them.

    SOURCE = AMX_TILES_C + my_kernels   # then, under #ifdef MK_AMX: mk_tile_config, mk_amx_permit()

``MK_AMX`` is defined where the compiler targets AMX's tiles and bf16 (-march=native on such a CPU) on Linux.
``mk_tile_config`` is the 64-byte palette-1 configuration ``_tile_loadconfig`` reads. ``mk_amx_permit()`` asks
Linux once for this process's permission to use the tiles (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; the
permission is the process's, for all its threads) and returns whether it was granted. Used by
``minituner.native_lora`` (the adapters' thin products) and ``miniquant.nf4_amx`` (an NF4 weight's GEMM).
"""

AMX_TILES_C = r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MK_AMX 1
#include <immintrin.h>
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
#endif
"""

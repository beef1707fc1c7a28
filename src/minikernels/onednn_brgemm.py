"""oneDNN's bf16 brgemm micro-kernel as PyTorch ships it, for our C kernels to call: the addresses of
``at::native::cpublas::brgemm`` (bf16 · bf16 -> fp32) and ``brgemm_release`` in libtorch_cpu.

    fns = brgemm_bf16()      # (brgemm, release) as integers for a C function pointer, or None
    # C: brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, true): C (M, N; fp32, ldc) (+)= A (M, K; bf16 rows, lda)
    #    · B, B in the VNNI layout: K / 2 lines of ldb pairs (B[2p][n], B[2p + 1][n]), the even k low;
    #    then release(true) on each thread that called it, before anything else configures the tiles

PyTorch's own C++ kernels (its CPU flash attention, the GEMM templates torch.compile writes) call these two; their
names are the C++ ones (Itanium ABI), their arguments plain integers, a bool and pointers, so a C caller passes
them as they are. PyTorch compiles one kernel per shape (M, N, K, lda, ldb, ldc, add_C) and keeps it for the
process's life, a copy per thread (about 190 KiB each, measured on an Intel Xeon with AMX): a caller bounds the
shapes it asks for. Per thread it also remembers which kernel last configured the tiles: ``release`` forgets that
and releases the tiles, so the next caller (ours or PyTorch's) configures them again.

Taken only where PyTorch itself would pack bf16 operands for it, asked on every call (``could_pack``: a CPU with
AMX, and oneDNN available and enabled, which ``torch.backends.mkldnn.flags(enabled=False)`` turns off for the
while; there PyTorch's brgemm refuses the VNNI layout by throwing a C++ exception, which would end the process
from inside our C), so the layout above is the one it reads; None where libtorch_cpu or a name is missing (a
PyTorch built otherwise, another OS): the callers then keep their other paths.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

BRGEMM_BF16 = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"  # brgemm(..., const BFloat16*, ...)
RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"  # brgemm_release(bool is_vnni)
COULD_PACK = "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"  # could_pack(ScalarType)
BFLOAT16 = 15  # c10::ScalarType::BFloat16


def library_path() -> str:
    """Where PyTorch keeps libtorch_cpu (already loaded by `import torch`)."""
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


@lru_cache(maxsize=None)
def _functions() -> tuple[int, int, ctypes._CFuncPtr] | None:
    """(brgemm's address, release's address, could_pack) from libtorch_cpu, or None (looked up once)."""
    try:
        lib = ctypes.CDLL(library_path())
        brgemm, release, could_pack = (getattr(lib, name) for name in (BRGEMM_BF16, RELEASE, COULD_PACK))
    except (OSError, AttributeError):
        return None
    could_pack.argtypes, could_pack.restype = [ctypes.c_int8], ctypes.c_bool
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    return address(brgemm), address(release), could_pack


def brgemm_bf16() -> tuple[int, int] | None:
    """(brgemm, release): the two functions' addresses, or None where they are not there or PyTorch does not pack
    bf16 operands for brgemm now (asked each call: oneDNN can be switched off and on)."""
    found = _functions()
    if found is None or not found[2](BFLOAT16):
        return None
    return found[0], found[1]

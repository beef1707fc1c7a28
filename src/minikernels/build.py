"""Small C kernels: compiled on first use with the system C compiler, cached, loaded with ctypes, run on threads.

    family = KernelFamily("nf4", SOURCE, CFLAGS, "miniquant's NF4 kernels", NativeKernels)
    k = family.kernels()     # built once and wrapped; None: MINIQUANT_NATIVE=0, no compiler or a failed build
    split = ThreadSplit("miniquant")                   # a pool shared by every call of one kernel family
    split.run(blocks, values_per_block, lambda b0, b1: lib.kernel(..., b0, b1), min_values, chunk_values)

Used by ``miniquant.native`` (NF4) and minigpt's bf16 kernels (``native_loss``, ``native_attention``,
``native_norm``, ``native_swiglu``, ``native_rope``). A library is cached under $MINIQUANT_CACHE (default:
<tmp>/miniquant-<uid>), keyed by a hash of the source, the flags, the compiler's version and the CPU's feature
flags (kernels are built with -march=native), so a changed source or another CPU builds afresh.

Threads: a source that starts with OPENMP_PRELUDE can split a kernel's range over OpenMP threads (its
MK_PARALLEL_RANGES macro); its family, made with ``parallel=True``, is compiled with -fopenmp where the compiler
can. Its libgomp.so.1 is then the one PyTorch loaded (same soname), so the kernels run on PyTorch's own OpenMP
team. That matters: after each of PyTorch's parallel ops its worker threads spin a while waiting for the next,
and on a 2-core machine a Python thread of ours competing with that spinner made an NF4 dequantization right
after a matrix product 1.9x slower than alone (3.7 vs 2.0 ms, 8192 x 2048 bf16, Intel Xeon); on PyTorch's team
it takes 1.5 ms either way. Where OpenMP is not available, Python threads run the ranges instead (ctypes
releases the GIL during a call).
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch

CACHE_ENV = "MINIQUANT_CACHE"  # folder for the compiled libraries
NATIVE_ENV = "MINIQUANT_NATIVE"  # set to 0 to never build or use native kernels (NF4, the bf16 loss and attention)
CPU_COUNT = os.cpu_count() or 1  # asked once: the call costs microseconds
HUGE_PAGE_MIN_BYTES = 8 << 20  # fresh_tensor asks for transparent huge pages from this size on
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more; so a
# block this large is always a mapping of its own, unmapped when freed
MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>


@lru_cache(maxsize=None)
def _libc_madvise():
    """libc's madvise through ctypes, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def fresh_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a kernel's output (NF4's and the bf16 loss's); a large one first asks for
    transparent huge pages (advisory), so that the first write into it faults once per 2 MiB instead of per
    4 KiB: a fresh 131 MB bf16 gradient took 33 ms of page faults to fill on the machine of
    benchmarks/RESULTS.md, its computation 13."""
    t = torch.empty(shape, dtype=dtype)
    madvise = _libc_madvise()
    if madvise is not None and t.nbytes >= HUGE_PAGE_MIN_BYTES:
        huge = 1 << 21
        start = (t.data_ptr() + huge - 1) & ~(huge - 1)
        stop = (t.data_ptr() + t.nbytes) & ~(huge - 1)
        if stop > start:
            madvise(start, stop - start, MADV_HUGEPAGE)
    return t


def find_compiler() -> str | None:
    """$CC, else cc, gcc or clang on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"miniquant-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return Path(os.environ.get(CACHE_ENV, default))


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in a /proc/cpuinfo text (x86 'flags', Arm 'Features')."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


CPUINFO = Path("/proc/cpuinfo")


@lru_cache(maxsize=None)
def cpu_flag_set(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags in a /proc/cpuinfo file (``parse_cpu_flags``), read once per file and process (a
    CPU's flags do not change; on a machine of hundreds of cores the kernel takes milliseconds to write that file);
    empty where it cannot be read (not Linux)."""
    try:
        return parse_cpu_flags(cpuinfo.read_text())
    except OSError:
        return frozenset()


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(name: str, source: str, cflags: list[str], compiler: str, libs: tuple[str, ...] | list[str] = ()
                  ) -> Path:
    """The shared library of `source` compiled with `cflags` and linked with `libs` (after the source, e.g. -lm;
    cached); RuntimeError with the compiler's last line."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([source, " ".join(cflags), " ".join(libs), version, cpu_flags(),
                                     platform.machine()]).encode())
    target = cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        result = subprocess.run([compiler, *cflags, str(src), *libs, "-o", str(out)], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
        os.replace(out, target)  # atomic: concurrent builders leave one complete file
    return target


def load_library(name: str, source: str, cflags: list[str], what: str, libs: tuple[str, ...] | list[str] = ()
                 ) -> ctypes.CDLL | None:
    """build_library with the system compiler, loaded; None when there is none or the build fails (a warning
    naming `what` says why): the caller then runs its PyTorch ops."""
    compiler = find_compiler()
    if compiler is None:
        return None
    try:
        return ctypes.CDLL(str(build_library(name, source, cflags, compiler, libs)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"building {what} failed ({e}); using PyTorch ops instead")
        return None


OPENMP_PRELUDE = r"""
#include <stdint.h>
/* minikernels.build: mk_openmp() says whether this library was built with OpenMP; MK_PARALLEL_RANGES(b0, b1,
   r0, r1, CALL) runs CALL for `chunks` consecutive ranges [r0, r1) of [b0, b1), as threads of the team get free,
   on `threads` threads (both parameters of the enclosing function); without OpenMP, one after another */
int mk_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
#define MK_PARALLEL_RANGES(b0, b1, r0, r1, CALL) do { \
    const int64_t mk_first = (b0), mk_n = (b1) - (b0); \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)") \
    for (int64_t mk_c = 0; mk_c < chunks; mk_c++) { \
        const int64_t r0 = mk_first + mk_n * mk_c / chunks, r1 = mk_first + mk_n * (mk_c + 1) / chunks; \
        CALL; \
    } \
} while (0)
"""
OPENMP_FLAG = "-fopenmp"


def parallel_entry(lib: ctypes.CDLL, serial) -> Callable[..., None]:
    """lib's MK_PARALLEL_RANGES entry point for the kernel `serial` (a ctypes function with its argtypes set):
    `<name>_parallel`, taking serial's arguments and then (chunks, threads)."""
    entry = getattr(lib, f"{serial.__name__}_parallel")
    entry.argtypes = [*serial.argtypes, ctypes.c_int64, ctypes.c_int]
    entry.restype = None
    return entry


K = TypeVar("K")


class KernelFamily(Generic[K]):
    """One C source's kernels behind their Python wrapper `wrap(lib)`, built and wrapped on first use, once.

    kernels() is None when native kernels are off ($MINIQUANT_NATIVE=0), there is no compiler, the build failed,
    or, where `vectorized` names a C function returning whether the SIMD path was compiled in, the library was
    built without it (a plain-C loop some kernels have only as a reference, slower than PyTorch's ops).
    With `parallel` (a source that includes OPENMP_PRELUDE), it is built with -fopenmp, or without it where that
    build fails (the wrapper asks `lib.mk_openmp()` which it got)."""

    def __init__(self, name: str, source: str, cflags: list[str], what: str, wrap: Callable[[ctypes.CDLL], K],
                 libs: tuple[str, ...] | list[str] = (), vectorized: str | None = None, parallel: bool = False
                 ) -> None:
        self.name, self.source, self.cflags, self.what, self.libs = name, source, cflags, what, libs
        self.wrap, self.vectorized, self.parallel = wrap, vectorized, parallel
        self._lock = threading.Lock()
        self._built: tuple[K | None] | None = None  # (kernels or None,) once the build was tried

    def usable(self, lib: ctypes.CDLL | None) -> K | None:
        """The wrapped kernels of a built library; None when there is none or it lacks the SIMD path."""
        if lib is None or (self.vectorized is not None and not getattr(lib, self.vectorized)()):
            return None
        return self.wrap(lib)

    def kernels(self) -> K | None:
        if os.environ.get(NATIVE_ENV, "1") == "0":
            return None
        if self._built is None:
            with self._lock:  # two threads asking at once build once
                if self._built is None:
                    self._built = (self.usable(self._load()),)
        return self._built[0]

    def _load(self) -> ctypes.CDLL | None:
        compiler = find_compiler() if self.parallel else None
        if compiler is not None:  # with OpenMP where this compiler has it; quietly without where it has not
            try:
                return ctypes.CDLL(str(build_library(self.name, self.source, [*self.cflags, OPENMP_FLAG], compiler,
                                                     self.libs)))
            except (OSError, RuntimeError, subprocess.SubprocessError):
                pass
        return load_library(self.name, self.source, self.cflags, self.what, self.libs)


_forked_child = False  # this process is a fork of the one that imported this module


def _mark_forked_child() -> None:
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_child)


def in_forked_child() -> bool:
    """Whether this process was forked after minikernels.build was imported: there OpenMP is never used (a child of
    a process whose OpenMP team ever ran waits forever for that team in libgomp; PyTorch's own parallel ops hang
    there too), whether its kernel families were built before the fork or after."""
    return _forked_child


class ThreadSplit:
    """Runs call(b0, b1) over [0, units) on up to torch.get_num_threads() threads: OpenMP's, through the kernel's
    own parallel entry point, where `openmp` (the library was built with it) and this is not a forked child, else
    Python threads of a pool started on first need."""

    def __init__(self, name: str, openmp: bool = False) -> None:
        self.name, self.openmp = name, openmp and not in_forked_child()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # a forked child has none of the pool's threads: start afresh
            os.register_at_fork(after_in_child=self._forget_pool)

    def _forget_pool(self) -> None:
        self._pool, self._lock = None, threading.Lock()
        # a forked child of a process whose OpenMP team ever ran waits forever for that team (libgomp; PyTorch's own
        # parallel ops hang there too): the child's kernels run on Python threads
        self.openmp = False

    @staticmethod
    def threads(values: int, min_values: int) -> int:
        """How many threads `run` gives a call of `values` values, each at least `min_values` (1: this thread)."""
        return 1 if values < 2 * min_values else min(torch.get_num_threads(), CPU_COUNT, values // min_values)

    def run(self, units: int, unit_values: int, call: Callable[[int, int], None], min_values: int,
            chunk_values: int, parallel: Callable[[int, int, int, int], None] | None = None) -> None:
        """call(b0, b1) over [0, units): threads take chunks of about `chunk_values` values as they get free,
        each thread at least `min_values` values (fewer values stay on the calling thread). `parallel(b0, b1,
        chunks, threads)`, the kernel's MK_PARALLEL_RANGES entry point, does the same in C on OpenMP's threads
        and is used where the library has OpenMP.

        Many chunks per thread, taken as threads get free: on a busy machine a thread that waits for a core
        leaves its share to the others instead of holding up the whole call."""
        values = units * unit_values
        threads = self.threads(values, min_values)
        if threads <= 1:
            call(0, units)
            return
        chunks = min(units, max(threads, values // chunk_values))
        if parallel is not None and self.openmp:
            parallel(0, units, chunks, threads)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=CPU_COUNT, thread_name_prefix=self.name)
            pool = self._pool
        bounds = [units * c // chunks for c in range(chunks + 1)]
        counter = itertools.count()  # next() is atomic under the GIL
        stop = threading.Event()

        def worker() -> None:
            for c in iter(lambda: next(counter), None):
                if c >= chunks or stop.is_set():
                    return
                try:
                    call(bounds[c], bounds[c + 1])
                except BaseException:
                    stop.set()  # one error ends the call: the other threads take no further chunk
                    raise

        futures = [pool.submit(worker) for _ in range(threads - 1)]
        try:
            worker()
        finally:  # however this thread leaves (an error, KeyboardInterrupt), no kernel may outlive the call:
            stop.set()  # the caller frees the tensors they write
            wait(futures)
        for f in futures:
            f.result()  # a worker's error

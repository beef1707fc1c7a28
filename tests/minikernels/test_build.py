"""minikernels.build: ThreadSplit runs every range once, on threads, and an error stops the others before it
returns; KernelFamily builds once, and says None when native kernels are off or not vectorized; OPENMP_PRELUDE's
parallel ranges cover every value once, on PyTorch's own libgomp."""
import ctypes
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minikernels import build
from minikernels.build import KernelFamily, ThreadSplit


def test_every_unit_once_and_errors_after_every_thread_stopped(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("minikernels.build.CPU_COUNT", 2)
    split, seen, lock = ThreadSplit("test"), [], threading.Lock()

    def record(b0, b1):
        with lock:
            seen.extend(range(b0, b1))

    split.run(1000, 10, record, min_values=100, chunk_values=50)
    assert sorted(seen) == list(range(1000))

    running = []

    def fail_first(b0, b1):
        with lock:
            running.append(b0)
        if b0 == 0:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        split.run(1000, 10, fail_first, min_values=100, chunk_values=50)
    count = len(running)
    assert count < 200  # the others stopped taking chunks
    assert len(running) == count  # and nothing runs after run() returned


def test_a_kernel_family_builds_once_and_is_none_when_off_absent_or_not_vectorized(monkeypatch):
    builds = []

    def fake_load(name, source, cflags, what, libs=()):
        builds.append(name)
        time.sleep(0.05)  # a build takes a while: the other threads ask meanwhile
        return SimpleNamespace(vec=lambda: 1)

    monkeypatch.setattr(build, "load_library", fake_load)
    family = KernelFamily("fam", "int x;", ["-O2"], "test kernels", lambda lib: ("wrapped", lib), vectorized="vec")
    monkeypatch.setenv(build.NATIVE_ENV, "0")
    assert family.kernels() is None and builds == []  # off: nothing is built
    monkeypatch.delenv(build.NATIVE_ENV)
    threads = [threading.Thread(target=family.kernels) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = family.kernels()
    assert first[0] == "wrapped" and family.kernels() is first and builds == ["fam"]

    assert family.usable(None) is None  # no compiler or a failed build
    assert family.usable(SimpleNamespace(vec=lambda: 0)) is None  # built without the SIMD path
    plain = KernelFamily("nf4ish", "", [], "t", lambda lib: lib)  # no `vectorized`: any built library serves
    assert plain.usable(SimpleNamespace()) is not None


_RANGES_SOURCE = build.OPENMP_PRELUDE + r"""
/* each value of [b0, b1) gets +1 per visit: a range visited twice or never shows */
void bump(int32_t* x, int64_t b0, int64_t b1) { for (int64_t i = b0; i < b1; i++) x[i] += 1; }
void bump_parallel(int32_t* x, int64_t b0, int64_t b1, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, r0, r1, bump(x, r0, r1));
}
"""


def _ranges_library(tmp_path, monkeypatch, openmp: bool):
    compiler = build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    flags = ["-O2", "-fPIC", "-shared", *([build.OPENMP_FLAG] if openmp else [])]
    try:
        lib = ctypes.CDLL(str(build.build_library("ranges", _RANGES_SOURCE, flags, compiler)))
    except RuntimeError as e:
        pytest.skip(f"this compiler cannot build it: {e}")
    lib.bump_parallel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


@pytest.mark.parametrize("openmp", [True, False])
def test_parallel_ranges_visit_every_value_once_with_and_without_openmp(tmp_path, monkeypatch, openmp):
    lib = _ranges_library(tmp_path, monkeypatch, openmp)
    assert lib.mk_openmp() == int(openmp)
    x = torch.zeros(10_007, dtype=torch.int32)
    for b0, b1, chunks, threads in [(0, 10_007, 37, 2), (5, 9_000, 1, 2), (100, 103, 3, 4), (0, 10_007, 7, 1)]:
        x.zero_()
        lib.bump_parallel(x.data_ptr(), b0, b1, chunks, threads)
        inside = torch.zeros_like(x)
        inside[b0:b1] = 1
        assert torch.equal(x, inside), (b0, b1, chunks, threads)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_an_openmp_kernel_runs_on_the_libgomp_pytorch_loaded(tmp_path, monkeypatch):
    """Our libraries name libgomp.so.1; with PyTorch's (same soname) already loaded, the loader binds to it, so the
    kernels run on PyTorch's OpenMP team instead of starting a second set of threads beside its spinning ones."""
    torch_gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    if not torch_gomp:
        pytest.skip("this PyTorch build does not use libgomp")
    lib = _ranges_library(tmp_path, monkeypatch, openmp=True)
    x = torch.zeros(1000, dtype=torch.int32)
    lib.bump_parallel(x.data_ptr(), 0, 1000, 8, 2)
    after = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert after == torch_gomp and bool((x == 1).all())


def test_threadsplit_hands_openmp_the_whole_range_and_a_forked_child_falls_back(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("minikernels.build.CPU_COUNT", 2)
    split, calls = ThreadSplit("test-omp", openmp=True), []
    split.run(1000, 10, lambda b0, b1: calls.append(("py", b0, b1)), min_values=100, chunk_values=50,
              parallel=lambda b0, b1, chunks, threads: calls.append(("omp", b0, b1, chunks, threads)))
    assert calls == [("omp", 0, 1000, 200, 2)]
    calls.clear()
    split.run(10, 10, lambda b0, b1: calls.append(("py", b0, b1)), min_values=100, chunk_values=50,
              parallel=lambda *a: calls.append(("omp", *a)))
    assert calls == [("py", 0, 10)]  # too small to split: the calling thread, no team
    split._forget_pool()  # what a forked child runs (os.register_at_fork)
    assert split.openmp is False


def test_a_split_made_in_a_forked_child_never_uses_openmp():
    """A kernel family first built in a forked child (its ThreadSplit made after the fork) runs on Python threads
    too: the child's libgomp would wait for the parent's team."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what a split made here would use, then leave without cleanup, whatever happens
        try:
            os.write(write, b"%d%d" % (build.in_forked_child(), ThreadSplit("child", openmp=True).openmp))
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"10"
    assert ThreadSplit("parent", openmp=True).openmp == (not build.in_forked_child())  # pytest may itself be a fork


def test_a_parallel_family_tries_openmp_first_and_quietly_builds_without(monkeypatch, recwarn):
    tried, loaded = [], []

    def no_openmp(name, source, cflags, compiler, libs=()):
        tried.append(list(cflags))
        raise RuntimeError("unsupported option '-fopenmp'")

    monkeypatch.setattr(build, "find_compiler", lambda: "cc")
    monkeypatch.setattr(build, "build_library", no_openmp)
    monkeypatch.setattr(build, "load_library", lambda name, source, cflags, what, libs=(): loaded.append(cflags) or "lib")
    family = KernelFamily("par", "int x;", ["-O2"], "test kernels", lambda lib: lib, parallel=True)
    assert family.kernels() == "lib"
    assert tried == [["-O2", build.OPENMP_FLAG]] and loaded == [["-O2"]] and not recwarn.list

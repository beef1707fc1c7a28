"""minikernels.build: ThreadSplit runs every range once, on threads, and an error stops the others before it
returns; KernelFamily builds once, and says None when native kernels are off or not vectorized."""
import threading
import time
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

"""minikernels.build.ThreadSplit: every range once, on threads; an error stops the others before it returns."""
import threading

import pytest
import torch

from minikernels.build import ThreadSplit


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

"""The heap trims a CPU training forward makes (where they are, when they run, that they change no number), and
keep_freed_memory, which stops glibc handing a step's freed memory back between steps."""
from __future__ import annotations

import pickle
import platform

import pytest
import torch
import torch.nn.functional as F

from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minituner.build import build_for_training
from minituner.lora import LoRAConfig
from minituner.memory import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def minigpt(n_layer: int) -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, d_model=16))


def decoder(n_layer: int) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=64, n_layer=n_layer, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                                 block_size=16))


@pytest.fixture
def trims(monkeypatch) -> list[int]:
    """Count the trims, with the heap reporting just enough resident free memory for each to happen."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(heap, "free_to_trim", lambda: heap.TRIM_MIN_FREE_BYTES)
    monkeypatch.setitem(heap._after_last_trim, "outside", None)
    return calls


@glibc
def test_trim_heap_calls_glibc():
    assert heap.trim_heap() is True
    assert isinstance(heap.heap_free_bytes(), int)


@glibc
def test_no_trim_while_the_heap_holds_little_free(trims, monkeypatch):
    """Below TRIM_MIN_FREE_BYTES free, handing pages back would save little and cost their faults later."""
    monkeypatch.setattr(heap, "free_to_trim", lambda: heap.TRIM_MIN_FREE_BYTES - 1)
    model = minigpt(9)
    heap.trim_heap_in_forward(model)
    model(torch.randint(0, 64, (2, 8)))
    assert trims == []


def test_free_to_trim_counts_what_became_resident_since_the_last_trim(monkeypatch):
    """Before any trim, every free byte may be resident; after one, only the growth of the anonymous resident memory
    beyond malloc's bytes in use: the pages trimmed stay free in malloc's books but are no longer resident."""
    MiB = 2**20
    readings = {"outside": 300 * MiB, "free": 200 * MiB}
    monkeypatch.setattr(heap, "outside_malloc_bytes", lambda: readings["outside"])
    monkeypatch.setattr(heap, "heap_free_bytes", lambda: readings["free"])
    monkeypatch.setattr(heap, "trim_heap", lambda: True)
    monkeypatch.setitem(heap._after_last_trim, "outside", None)
    assert heap.free_to_trim() == 200 * MiB
    readings["outside"] = 120 * MiB  # the trim gave 180 MiB back; the free bytes stay free
    assert heap.trim_now() and heap._after_last_trim["outside"] == 120 * MiB
    assert heap.free_to_trim() == 0
    readings["outside"] = 170 * MiB  # a step faulted 50 MiB in again and freed it
    assert heap.free_to_trim() == 50 * MiB
    readings["outside"] = 100 * MiB  # the process's own memory shrank: the new floor
    assert heap.free_to_trim() == 0 and heap._after_last_trim["outside"] == 100 * MiB
    readings["outside"] = 110 * MiB
    assert heap.free_to_trim() == 10 * MiB


def test_free_to_trim_without_glibcs_figures(monkeypatch):
    monkeypatch.setattr(heap, "outside_malloc_bytes", lambda: None)
    monkeypatch.setattr(heap, "heap_free_bytes", lambda: None)
    monkeypatch.setitem(heap._after_last_trim, "outside", 5)
    assert heap.free_to_trim() is None


RESIDENT = r"""
import sys, torch
from minituner.memory import heap
heap.keep_freed_memory()  # as build_for_training sets it: what a step frees stays in the heap
MiB = 2**20
kept = []
def churn():  # a step's pattern in small: 128 MiB in blocks of 8 MiB, held together, then freed, while a tensor
    held = [torch.ones(1 << 21) for _ in range(16)]  # made after them lives on (a hole, not the heap's top)
    kept.append(torch.ones(1 << 18))
    del held
churn()
first = heap.free_to_trim()
heap.trim_now()
after = heap.free_to_trim(), heap.heap_free_bytes()
churn()
print(first // MiB, after[0] // MiB, after[1] // MiB, heap.free_to_trim() // MiB)
"""


@glibc
def test_a_trimmed_heap_is_not_trimmed_again_until_its_pages_are_resident_again():
    """In a fresh process (the allocator's setting is process-wide): 128 MiB freed is resident free; after the trim
    malloc still counts it free (the old gate trimmed again at every trim point) but nothing is left to give back,
    until a step faults it in and frees it again."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RESIDENT], capture_output=True, text=True, check=True)
    first, after, free_after, again = map(int, out.stdout.split())
    assert first >= 120 and free_after >= 120  # free in malloc's books before and after the trim
    assert after < 8  # but no longer resident
    assert 100 <= again <= 140  # resident again after the next churn


@pytest.mark.parametrize("make", [minigpt, decoder])
def test_trim_points_every_eighth_block_and_the_head(make):
    model = make(17)
    blocks = list(model.blocks) if hasattr(model, "blocks") else list(model.model.layers)
    assert heap.trim_points(model) == [blocks[8], blocks[16], model.lm_head]
    small = make(2)
    assert heap.trim_points(small) == [small.lm_head]


def test_a_model_without_blocks_or_head_has_no_trim_points():
    assert heap.trim_points(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


@glibc
@pytest.mark.parametrize("method,precision", [("lora", "fp32"), ("qlora", "fp32"), ("full", "fp32"),
                                              ("lora", "bf16"), ("qlora", "bf16")])
def test_build_for_training_trims_during_a_training_forward_only(trims, method, precision):
    """The trims go on last, on the modules the model ends with (bf16 compute replaces the head)."""
    model = build_for_training(minigpt(9), method, LoRAConfig(r=2, alpha=4.0), device="cpu", precision=precision,
                               allow_slow_bf16=True)
    x = torch.randint(0, 64, (2, 8))
    model.train()
    model(x)
    assert len(trims) == 2  # before block 8 and before the head
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert len(trims) == 2  # no backward follows: nothing saved, nothing to trim
    assert heap.trim_heap_in_forward(model) == 0  # installed once



@glibc
def test_trims_change_no_number():
    """Trimming frees pages, never tensors: a step with the trims equals one without, bit for bit."""
    def step(trim: bool) -> tuple[float, torch.Tensor]:
        model = minigpt(9)
        if trim:
            assert heap.trim_heap_in_forward(model) == 2
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss.item(), model.blocks[0].attn.q_proj.weight.grad

    (l1, g1), (l2, g2) = step(True), step(False)
    assert l1 == l2 and torch.equal(g1, g2)


def test_a_model_with_trims_pickles():
    model = minigpt(9)
    heap.trim_heap_in_forward(model)
    pickle.loads(pickle.dumps(model))


# ---- keep_freed_memory: what one step frees stays for the next ----------------------------------------------

CHURN = r"""
import resource, sys, torch
from minituner.memory import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def churn():  # a step's pattern in small: 128 MiB in blocks of 8 MiB, held together, then freed
    for _ in range(5):
        held = [torch.ones(1 << 21) for _ in range(16)]  # 16 x 8 MiB
        del held
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    kept, faults = out.stdout.split()
    return kept, int(faults)


@glibc
def test_keep_freed_memory_stops_the_page_faults_of_a_repeated_step():
    """Kept, a round reuses the pages the last one freed. Handed back, every page faults in again (5 rounds x 16 x
    2,048 pages): shown with glibc's mmap threshold at its starting 128 KiB, where each block is its own mapping.
    glibc's own default moves that threshold as blocks are freed, so whether it hands this pattern back depends
    on the heap's layout (in one process all of it, in another none): the bench's step times are the measure.
    Each in a fresh process: the setting is process-wide."""
    assert _faults("default", {"MALLOC_MMAP_THRESHOLD_": "131072"})[1] > 5 * 16 * 2048 // 2
    kept, faults = _faults("keep")
    assert kept == "True" and faults < 100


@glibc
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_keep_freed_memory_leaves_a_users_glibc_setting(env):
    kept, faults = _faults("keep", env)
    assert kept == "False" and faults > 5 * 16 * 2048 // 2


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.mallopt = lambda param, value: self.calls.append((param, value)) or 1


@pytest.fixture
def libc(monkeypatch) -> _FakeLibc:
    fake = _FakeLibc()
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    monkeypatch.setitem(heap._allocator, "set_by", None)
    for name in (*heap.USER_ALLOCATOR_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_keep_freed_memory_sets_the_largest_mmap_threshold_and_no_trim(libc):
    assert heap.keep_freed_memory() is True
    assert libc.calls == [(heap.M_MMAP_THRESHOLD, 32 * 2**20), (heap.M_TRIM_THRESHOLD, 2**31 - 1)]
    assert heap.keep_freed_memory() is True and len(libc.calls) == 2  # once per process


def test_pin_allocator_wins_over_keep_freed_memory(libc):
    """memory-check pins the allocator to measure, then builds the model (which asks to keep): the pin stays."""
    assert heap.pin_allocator(16384) is True
    assert heap.keep_freed_memory() is False
    assert libc.calls == [(heap.M_MMAP_THRESHOLD, 16384), (heap.M_TRIM_THRESHOLD, 16384)]


def test_keep_freed_memory_without_glibc(libc, monkeypatch):
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.keep_freed_memory() is False


@pytest.mark.parametrize("heap_trims", [True, False])
def test_build_for_training_keeps_freed_memory_on_cpu(monkeypatch, heap_trims):
    """With or without the trims in the forward (--no-heap-trims): the trims bound the peak, keeping stops the churn."""
    import minituner.build as build

    calls = []
    monkeypatch.setattr(build, "keep_freed_memory", lambda: calls.append(1) or True)
    build_for_training(minigpt(2), "lora", LoRAConfig(r=2, alpha=4.0), device="cpu", heap_trims=heap_trims)
    assert calls == [1]

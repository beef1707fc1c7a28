"""glibc's heap and the resident set: what a CPU training run holds beyond its live tensors, and how to give it back.

PyTorch's CPU tensors come from glibc's malloc. By default glibc serves a large block by mmap only until
the first such block is freed; then it raises its mmap threshold and serves blocks of that size from the
heap, where a freed block stays resident: reused when a later request fits into it, otherwise held.
A training forward allocates the activations it saves (kept) between temporaries it frees (holes), so the
holes pile up: on a Llama-2-7B-shaped QLoRA bf16 step (batch 1 x 512) the resident set at the end of the
forward was over a GiB above the live tensors (benchmarks/RESULTS.md, the real-model section).

Two remedies, each a glibc call through ctypes (a no-op returning False elsewhere):
- ``trim_heap`` (``malloc_trim(0)``) hands the free pages inside the heap back to the system now. A later
  allocation that lands there faults its pages in again, zeroed: time in proportion to what was handed back.
  ``trim_heap_in_forward`` calls it during a training forward, before every ``TRIM_EVERY_BLOCKS``-th block
  and before the head (where the loss's (N, V) tensors are about to be made), whenever the heap then holds
  at least ``TRIM_MIN_FREE_BYTES`` free (``heap_free_bytes``): on the 7B shape most of the excess goes, for
  a few percent of step time at most (the bench runs ours with and without). Trimming before every
  block gave back little more and cost more; trimming only before the head left most of it.
  ``build_for_training`` installs it on CPU (``finetune --no-heap-trims`` leaves it out). Under gradient
  checkpointing the backward's recomputation of a block runs its pre-hook again, so it trims there too.
- ``pin_allocator`` (``mallopt``) fixes the mmap threshold low, so every large block is its own mapping,
  handed back when freed: the resident set follows the live tensors exactly, and each new block faults its
  pages in (steps about half again as long on the 7B shape). ``minituner memory-check`` pins it to measure.

Between steps the opposite matters: glibc also hands memory back by itself, unmapping a freed block above its
mmap threshold and trimming the heap's top once more than twice that lies free there, and a step allocates
much of it again, each 4 KiB page faulted in and zeroed anew. On the bench's GPT-shaped bf16 QLoRA step
(benchmarks/bench_bf16.py; 8 layers, d_model 512, 1,024 tokens; AMD EPYC, 2 cores) that was about 9,000 page
faults a step and 8% of its time (257 against 234 ms, 2026-12-03). ``keep_freed_memory`` (``mallopt``, what
``build_for_training`` sets on CPU) fixes the mmap threshold at glibc's largest (32 MiB: larger tensors, a
big vocabulary's logits say, still get their own mapping and go back when freed) and turns the automatic
trim off, so a step reuses the pages the last one freed. The trims in the forward above still give back
what lies free when they run: they bound the peak, this only stops the churn. It changes nothing where the
allocator was set already: by ``pin_allocator`` (memory-check's measurement wins) or by the user through
glibc's environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``).
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch
import torch.nn as nn

from minigpt.model import block_list

TRIM_EVERY_BLOCKS = 8  # trim before blocks 8, 16, ... of a training forward (and before the head)
# trim only when the heap holds at least this much free memory: below it the pages handed back are few, and
# faulting them in again still costs (Lab 02's 200 K-parameter MiniGPT: about 8% of a step, trimming always)
TRIM_MIN_FREE_BYTES = 64 * 2**20


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33): every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
NEVER_TRIM = 2**31 - 1  # the largest trim threshold mallopt takes (an int): the heap's top is never trimmed
USER_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own settings, read at start
_allocator = {"set_by": None}  # "pin_allocator" or "keep_freed_memory": who called mallopt in this process


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def trim_heap() -> bool:
    """glibc: give the heap's free pages back to the system (``malloc_trim(0)``); False where not glibc."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:
        return False
    fn(0)
    return True


@lru_cache(maxsize=1)
def _mallinfo2():
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def heap_free_bytes() -> int | None:
    """glibc: the free bytes inside malloc's heaps (``mallinfo2().fordblks``); None where not available."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def pin_allocator(threshold: int) -> bool:
    """glibc: serve blocks above `threshold` bytes by mmap and give them back when freed; False where not glibc.

    Setting the threshold turns off glibc's dynamic threshold, which after the first large frees keeps
    them in the heap (resident, reused or not), so the resident set follows the live tensors."""
    if not _mallopt(threshold, threshold):
        return False
    _allocator["set_by"] = "pin_allocator"
    return True


def user_set_allocator(environ=os.environ) -> bool:
    """Whether this process's glibc malloc was configured through its environment (MALLOC_*_ or GLIBC_TUNABLES)."""
    return any(name in environ for name in USER_ALLOCATOR_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """glibc: keep what a training step frees for the next one (mmap threshold at its largest, no automatic trim);
    False, changing nothing, where not glibc, where ``pin_allocator`` pinned it or the environment set it."""
    if _allocator["set_by"] is not None:
        return _allocator["set_by"] == "keep_freed_memory"
    if user_set_allocator() or not _mallopt(LARGEST_MMAP_THRESHOLD, NEVER_TRIM):
        return False
    _allocator["set_by"] = "keep_freed_memory"
    return True


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def _trim_if_training(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: when this forward saves activations for a backward (or recomputes them) and the heap
    holds at least TRIM_MIN_FREE_BYTES free (or glibc cannot say), trim it."""
    if module.training and torch.is_grad_enabled():
        free = heap_free_bytes()
        if free is None or free >= TRIM_MIN_FREE_BYTES:
            trim_heap()


def trim_points(model: nn.Module) -> list[nn.Module]:
    """Where a training forward trims: every TRIM_EVERY_BLOCKS-th block after the first (``block_list``), then
    the head (``lm_head``). A model with neither has no trim points."""
    head = getattr(model, "lm_head", None)
    heads = [head] if isinstance(head, nn.Module) else []
    return [*block_list(model)[TRIM_EVERY_BLOCKS::TRIM_EVERY_BLOCKS], *heads]


def trim_heap_in_forward(model: nn.Module) -> int:
    """Install the trims of ``trim_points`` (once per model; a no-op where glibc is absent); return how many."""
    if getattr(model, "_heap_trims", False) or not hasattr(_libc(), "malloc_trim"):
        return 0
    points = trim_points(model)
    for m in points:
        m.register_forward_pre_hook(_trim_if_training)
    model._heap_trims = True
    return len(points)

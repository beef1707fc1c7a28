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
  at least ``TRIM_MIN_FREE_BYTES`` free that is resident (``free_to_trim``): on the 7B shape most of the
  excess goes, for a few percent of step time at most (the bench runs ours with and without). Trimming before
  every block gave back little more and cost more; trimming only before the head left most of it.
  Resident, because a trimmed page stays free in malloc's books (``mallinfo2().fordblks``) after the system has
  it back: gated on that count, a heap that once held the threshold free was trimmed at every trim point, each
  time handing back only what the step since had faulted in again. On the bench's GPT-shaped bf16 QLoRA step
  (8 layers, d_model 512, 1,024 tokens, one model in the process) the count hovered at 56 to 71 MiB before
  the head, about 48 MiB of it resident: when it crossed 64 MiB every step paid ~12,000 page faults, for a
  high-water mark no lower (564 to 571 MiB with the trims, 565 to 580 without; AMD EPYC, 2026-12-03). The
  resident part is estimated from the process's anonymous resident set (``/proc/self/statm``) less malloc's
  bytes in use, against the same difference right after the last trim (when no free heap page was resident):
  the rest is the process's own memory outside malloc (Python's arenas, thread stacks, JIT code).
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
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.model import block_list
from minikernels.build import GLIBC_MMAP_THRESHOLD_MAX

TRIM_EVERY_BLOCKS = 8  # trim before blocks 8, 16, ... of a training forward (and before the head)
# trim only when the heap holds at least this much resident free memory: below it the pages handed back are few,
# and faulting them in again still costs (Lab 02's 200 K-parameter MiniGPT: about 8% of a step, trimming always)
TRIM_MIN_FREE_BYTES = 64 * 2**20


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33): every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
LARGEST_MMAP_THRESHOLD = GLIBC_MMAP_THRESHOLD_MAX  # (32 MiB) mallopt refuses more
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
    """glibc: the free bytes inside malloc's heaps (``mallinfo2().fordblks``); None where not available. Resident
    or not: a trim hands a free page's memory back but leaves the page free in malloc's books."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def malloc_in_use_bytes() -> int | None:
    """glibc: the bytes malloc has handed out and not had back, in its heaps and mapped blocks (``mallinfo2``'s
    uordblks + hblkhd); None where not available."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks) + int(info.hblkhd)


def anonymous_resident_bytes() -> int | None:
    """Linux: the process's resident memory not backed by files (``/proc/self/statm``: resident - shared pages);
    None elsewhere. Mapped files (a checkpoint's pages, libraries) come and go with the page cache."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def outside_malloc_bytes() -> int | None:
    """Anonymous resident memory beyond malloc's bytes in use: the heap's resident free pages plus the process's
    memory outside malloc. None where either figure is not available."""
    resident, in_use = anonymous_resident_bytes(), malloc_in_use_bytes()
    return None if resident is None or in_use is None else resident - in_use


_after_last_trim = {"outside": None}  # outside_malloc_bytes() right after this process's last trim_heap()


def free_to_trim() -> int | None:
    """About how many of the heap's free bytes a trim would give back now: the growth of outside_malloc_bytes since
    right after the last trim (then no free heap page was resident). Before any trim, the heap's free bytes
    (heap_free_bytes: every free page may be resident). None where glibc cannot say.

    Where the process's own memory shrank below its level at the last trim (Python returning arenas), that lower
    level becomes the reference: the estimate never goes below 0, and errs towards fewer trims."""
    outside, reference = outside_malloc_bytes(), _after_last_trim["outside"]
    if outside is None or reference is None:
        return heap_free_bytes()
    if outside < reference:
        _after_last_trim["outside"] = reference = outside
    return outside - reference


def trim_now() -> bool:
    """trim_heap(), then note where outside_malloc_bytes stands (free_to_trim's reference); False where not glibc."""
    if not trim_heap():
        return False
    _after_last_trim["outside"] = outside_malloc_bytes()
    return True


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
    """Forward pre-hook: when this forward saves activations for a backward (or recomputes them) and a trim would
    give back at least TRIM_MIN_FREE_BYTES (free_to_trim; or glibc cannot say), trim the heap."""
    if module.training and torch.is_grad_enabled():
        free = free_to_trim()
        if free is None or free >= TRIM_MIN_FREE_BYTES:
            trim_now()


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

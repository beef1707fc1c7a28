"""A frozen Linear's product whose output glibc maps afresh on every call (a large vocabulary's logits), written
into transparent huge pages.

    if takes(x, weight, bias):
        y = linear(x, weight, bias)   # x·Wᵀ + b, the same bits as F.linear, the gradient for x as autograd's

glibc serves a block of at least its mmap threshold from a mapping of its own and unmaps it when freed; the
threshold is at most 32 MiB on 64-bit Linux (the largest mallopt takes, what ``minituner.memory.heap`` sets for a
training run), so every tensor of that size or more faults its pages in anew, one 4 KiB page at a time, each
zeroed. The head of a Llama-3-sized vocabulary makes one
every step: 512 tokens × 128,256 bf16 logits are 131 MB, 32,000 faults. Here the output is ``fresh_tensor``'s
(transparent huge pages asked for first: one fault per 2 MiB) and the product writes into it (``torch.mm`` /
``torch.addmm`` with ``out=``, the kernels F.linear runs, so the same bits). On an Intel Xeon with AMX (2 threads,
2026-12-06; 512 × 2,048 by 128,256 × 2,048 bf16, medians of 7) that product took 211 ms into a fresh tensor,
187 into fresh huge pages and 178 into a tensor written before; in the bench's 6-layer Llama-3.2-1B-shaped bf16
QLoRA step (one process, the two ways alternating step by step, 16 rounds) the step took 0.96x the time (median
per round; 0.78-1.04x; a first run of 10 rounds: 1.01x, 0.80-1.64x, medians of the steps 976 against 1,001 ms), its
page faults down from about 59,000 to 27,000 a step (the rest: the heap's pages trimmed before the head faulted in
again, ``minituner.memory.heap``).

A layer that passes its ``OutputStore`` (a bf16 training run's head: ``minituner.precision.keep_head_output``)
writes into the output it handed out last time instead, once nothing else holds any of it (no view, ``.data``,
``.detach()``, NumPy array or storage object of it is alive: a training step's logits are spent when its backward
is done): no fresh mapping, no page faults, no huge pages to assemble (the first fresh 131 MB in huge pages took
208 ms here, the kernel compacting memory for them, later ones 15 ms against 11 for the same writes into memory
written before). Where any of it is still held, or the output is larger, it takes fresh pages as above and keeps
those. A smaller output is a prefix of the one kept. In the bench's Llama-3.2-1B-shaped bf16 QLoRA step (Intel Xeon
with AMX, 2 threads, 2026-12-06; one process, the two ways alternating step by step, 12 rounds) the step took
0.960x the time (medians; 0.982x per round; a first run of 12 rounds: 0.974x, 0.975x). The step holds the logits at
its peak anyway, but now between steps too, beside whatever else is alive then: ``planner/peak.py`` counts them in
every phase, and a model that checkpoints its blocks keeps none (there the last block's backward, with the logits
beside it, would be the peak). What the planner does not count is glibc's heap growing back beside them in the
backward: on that step the resident high-water mark over three steps was 1,529 and 1,544 MiB keeping them against
1,457 and 1,455 without (5-6% more); the real 16-layer Llama-3.2-1B's bf16 train peak, 2,445 MiB, moved less.

For a frozen weight (and bias) on CPU, x in the weight's dtype, outside autocast: ``precision.Bf16Linear`` (bf16
runs' frozen Linears, the head among them) and ``precision.Fp32Linear`` where fp32 products are PyTorch's own
(``fp32_gemm.backend() == "aten"``; oneDNN's linear takes no output tensor). Autograd keeps W for x's gradient
(a reference, as for F.linear), which is g·W, as F.linear's backward computes it (tokens × in: small).
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from .build import GLIBC_MMAP_THRESHOLD_MAX, fresh_tensor

MAPPED_BYTES = GLIBC_MMAP_THRESHOLD_MAX  # (32 MiB) an output this large is a mapping of its own, every call


def output_bytes(x: Tensor, weight: Tensor) -> int:
    """Bytes of x·Wᵀ: x (..., in), weight (out, in), in the weight's dtype."""
    return x.numel() // max(x.shape[-1], 1) * weight.shape[0] * weight.element_size()


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``linear`` computes this product: CPU, strided, x in the weight's dtype, weight and bias frozen,
    outside CPU autocast, an output of at least MAPPED_BYTES."""
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    return (frozen and x.device.type == weight.device.type == "cpu" and x.layout == weight.layout == torch.strided
            and x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
            and not torch.is_autocast_enabled("cpu") and output_bytes(x, weight) >= MAPPED_BYTES)


def _holders(t: Tensor) -> tuple[int, int, int] | None:
    """(references to t's TensorImpl, to its storage, to its storage's Python object), as seen from here; None where
    this PyTorch cannot count the storage's."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()
    return t._use_count(), count(storage._cdata), sys.getrefcount(storage)


_UNHELD = _holders(torch.empty(1))  # a tensor nothing else refers to, counted the same way


class OutputStore:
    """A layer's last large output, written into again once nothing else holds any of it (see the module docstring).
    One per layer; not thread-safe (a layer's forward runs on one thread at a time)."""

    def __init__(self) -> None:
        self._kept: Tensor | None = None

    def __deepcopy__(self, memo: dict) -> OutputStore:  # a copied layer starts with nothing kept
        return OutputStore()

    def __reduce__(self):  # nor does a pickled one carry the output
        return OutputStore, ()

    def kept_bytes(self) -> int:
        """Bytes of the output kept (0 before the first)."""
        return 0 if self._kept is None else self._kept.nbytes

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """An uninitialised (rows, cols) tensor: a prefix of the kept output where it is large enough, of dtype and
        unheld (a view of it, so any later hold on it counts), else fresh (``fresh_tensor``), then kept."""
        n, kept = rows * cols, self._kept
        if kept is not None and kept.dtype == dtype and kept.numel() >= n and _UNHELD is not None \
                and _holders(kept) == _UNHELD:
            return kept[:n].view(rows, cols)
        self._kept = kept = None  # (the old one, where nothing else holds it, freed before the fresh one is made)
        self._kept = fresh_tensor((n,), dtype)
        return self._kept.view(rows, cols)


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None, store: OutputStore | None = None) -> Tensor:
    """x·Wᵀ + b into fresh huge pages (or `store`'s output), no autograd of its own: x (N, in) -> (N, out)."""
    shape = (x.shape[0], weight.shape[0])
    out = fresh_tensor(shape, weight.dtype) if store is None else store.take(*shape, weight.dtype)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class _FrozenLinear(torch.autograd.Function):
    """y = x·Wᵀ + b for a frozen W and b: x's gradient only."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, store: OutputStore | None) -> Tensor:
        ctx.save_for_backward(weight if x.requires_grad else None)
        rows = x.reshape(-1, x.shape[-1])  # (N, in): a view where x's rows are contiguous
        return product(rows, weight, bias, store).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        (weight,) = ctx.saved_tensors
        return grad_y @ weight if ctx.needs_input_grad[0] else None, None, None, None  # (..., out)·(out, in)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, store: OutputStore | None = None) -> Tensor:
    """F.linear for a product ``takes`` accepts: x (..., in) -> (..., out), the output in fresh huge pages or, with
    a layer's `store`, in its last output where nothing holds that any more."""
    return _FrozenLinear.apply(x, weight, bias, store)

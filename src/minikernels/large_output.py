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

For a frozen weight (and bias) on CPU, x in the weight's dtype, outside autocast: ``precision.Bf16Linear`` (bf16
runs' frozen Linears, the head among them) and ``precision.Fp32Linear`` where fp32 products are PyTorch's own
(``fp32_gemm.backend() == "aten"``; oneDNN's linear takes no output tensor). Autograd keeps W for x's gradient
(a reference, as for F.linear), which is g·W, as F.linear's backward computes it (tokens × in: small).
"""
from __future__ import annotations

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


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x·Wᵀ + b into fresh huge pages, no autograd of its own: x (N, in) -> (N, out)."""
    out = fresh_tensor((x.shape[0], weight.shape[0]), weight.dtype)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class _FrozenLinear(torch.autograd.Function):
    """y = x·Wᵀ + b for a frozen W and b: x's gradient only."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight if x.requires_grad else None)
        rows = x.reshape(-1, x.shape[-1])  # (N, in): a view where x's rows are contiguous
        return product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        (weight,) = ctx.saved_tensors
        return grad_y @ weight if ctx.needs_input_grad[0] else None, None, None  # (..., out)·(out, in)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear for a product ``takes`` accepts: x (..., in) -> (..., out), the output in fresh huge pages."""
    return _FrozenLinear.apply(x, weight, bias)

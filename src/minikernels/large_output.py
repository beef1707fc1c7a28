"""A frozen Linear whose output is large (a head's logits) written into a fresh tensor backed by huge pages.

    y = frozen_linear(x, weight, bias)   # F.linear's values; the weight (and bias) must not train

glibc serves a block of 32 MiB or more by a fresh mmap every time (its mmap threshold rises with use, to at most
32 MiB on 64-bit), so a tensor that large faults in every 4 KiB page on its first write, each one zeroed by the
kernel, on every step. A head's logits are such a tensor: Llama-3.2-1B's are 512 × 128,256 bf16 (131 MB), and on
the machine of benchmarks/RESULTS.md ``F.linear`` took about 326 ms to make them, a product into a fresh tensor
that asked for transparent huge pages first (``minikernels.build.fresh_tensor``) about 293 ms, into an existing
one about 288 ms (ad hoc, medians of 8). Smaller outputs, other devices and a trainable weight take F.linear.

The products are F.linear's own: ``torch.mm`` (``addmm`` with a bias) of x (rows) and Wᵀ (a view), and for x's gradient grad_y·W, so
values and gradients are bit for bit F.linear's (tested). Autograd keeps what it keeps for F.linear of a frozen
weight: the weight, when x needs a gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import fresh_tensor

FRESH_MAPPING_BYTES = 32 << 20  # glibc maps blocks at least this large afresh on every allocation (64-bit)


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether frozen_linear writes its own output: on CPU, a frozen weight, an output of FRESH_MAPPING_BYTES or
    more, and no autocast (which would change the product's dtype)."""
    if x.device.type != "cpu" or weight.requires_grad or (bias is not None and bias.requires_grad):
        return False
    if torch.is_autocast_enabled("cpu") or x.dtype != weight.dtype or x.dim() < 1:
        return False
    return x.numel() // max(1, x.shape[-1]) * weight.shape[0] * x.element_size() >= FRESH_MAPPING_BYTES


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        y = fresh_tensor((rows.shape[0], weight.shape[0]), x.dtype)  # (N, out)
        if bias is None:
            torch.mm(rows, weight.t(), out=y)
        else:
            torch.addmm(bias, rows, weight.t(), out=y)  # as F.linear adds it: inside the product
        ctx.save_for_backward(weight)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad_y.reshape(-1, weight.shape[0]).mm(weight)  # (N, in)
        return grad_x.view(ctx.x_shape), None, None


def frozen_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) for a frozen weight; a large CPU output lands in huge pages (``takes``)."""
    if not takes(x, weight, bias):
        return F.linear(x, weight, bias)
    return _FrozenLinear.apply(x, weight, bias)

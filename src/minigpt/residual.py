"""The residual add and the norm after it, as a pre-norm block runs them between its two halves.

    x, h = add_then_norm(x, self.attn(self.ln_1(x)), self.ln_2)   # x + attn(...), and ln_2 of that sum
    return x + self.mlp(h)

A norm module with an ``add_and_norm(x, branch)`` method (``minituner.precision``'s bf16-out norms, whose C does
the add and the norm in one pass each way: ``minigpt.native_norm``) computes both where it takes them; any other
norm, one that declines (returns None) or one with hooks of its own (which the fused path would skip), gets
``x + branch`` and then ``norm(x)``. The same values either way.
"""
from __future__ import annotations

import torch.nn as nn
from torch import Tensor


def add_then_norm(x: Tensor, branch: Tensor, norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(x + branch, norm(x + branch)): the residual stream after the add and the next half-block's input."""
    fused = getattr(norm, "add_and_norm", None)
    if fused is not None and not (norm._forward_hooks or norm._forward_pre_hooks):
        out = fused(x, branch)
        if out is not None:
            return out
    x = x + branch
    return x, norm(x)

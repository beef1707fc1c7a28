"""The residual add and the norm after it, as a pre-norm block runs them between its two halves.

    x, h = add_then_norm(x, self.attn(self.ln_1(x)), self.ln_2)   # x + attn(...), and ln_2 of that sum
    return x + self.mlp(h)

A norm module with an ``add_and_norm(x, branch)`` method (``minituner.precision``'s bf16-out norms, whose C does
the add and the norm in one pass each way: ``minigpt.native_norm``) computes both where it takes them; any other
norm, one that declines (returns None) or one with hooks of its own (which the fused path would skip), gets
``x + branch`` and then ``norm(x)``. The same values either way.

Across blocks the same holds: a block's last add (x + mlp(...)) and the next block's first norm are one pass too.
The model's loop runs each block as ``halves`` and hands the MLP's output on unadded:

    x, branch = block.halves(x, branch)        # the block before's output added in by this block's first norm
    _, h = add_then_norm(x, branch, self.ln_f)   # after the last block: the final norm adds it

A block with hooks of its own (which calling ``halves`` would skip: ``in_halves``), or one recomputed in backward
(gradient checkpointing takes the block's input whole), gets the pending add first (``add_pending``) and runs as a
module. On the bench's GPT-shaped bf16 QLoRA step (benchmarks/bench_bf16.py; AMD EPYC, 2 cores, 2026-12-05) the
joined adds removed 15 of 22 residual adds and 17 bf16 copies of the residual's gradient from a profiled step; in
three runs of alternating pairs of steps in one process the step was 2.02 ms faster (64 pairs), 0.78 ms slower
(32) and 1.08 ms faster (80): faster in 99 of 176 pairs, about 1 ms of a 180-215 ms step.
"""
from __future__ import annotations

import torch.nn as nn
from torch import Tensor


def add_then_norm(x: Tensor, branch: Tensor | None, norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(x + branch, norm(x + branch)): the residual stream after the add and the next half-block's input; with
    branch None (nothing to add: the first block), (x, norm(x))."""
    if branch is None:
        return x, norm(x)
    fused = getattr(norm, "add_and_norm", None)
    if fused is not None and not (norm._forward_hooks or norm._forward_pre_hooks):
        out = fused(x, branch)
        if out is not None:
            return out
    x = x + branch
    return x, norm(x)


def in_halves(block: nn.Module) -> bool:
    """Whether the model's loop may call block.halves instead of the module: no hooks of its own to skip."""
    return not (block._forward_hooks or block._forward_pre_hooks)


def add_pending(x: Tensor, branch: Tensor | None) -> Tensor:
    """x with the block before's unadded output added (branch None: nothing pending)."""
    return x if branch is None else x + branch

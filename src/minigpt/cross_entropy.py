"""Next-token cross-entropy that reads the logits in the dtype the head returns them.

    loss = cross_entropy(logits, targets)                    # mean over the targets that count
    total = cross_entropy(logits, targets, reduction="sum")  # their sum
    loss = cross_entropy(model(x), y, overwrite_logits=True)  # logits no one reads again: the gradient goes there

fp32 logits go to ``F.cross_entropy`` as they are, except large ones whose gradient may overwrite them (below).
Narrower logits (bf16 or fp16: a head computing in bf16, ``minituner.precision``) go through
``ChunkedCrossEntropy``: the loss is computed in fp32, a few rows at a time, and the gradient comes back in the
logits' dtype. Upcasting first (``F.cross_entropy(logits.float())``,
what transformers does) is the same arithmetic on the same values, but for a (N, V) batch it makes an fp32 copy
of the logits, keeps an fp32 log-softmax for the backward, and there makes two fp32 (N, V) gradients and casts
the last back: at Llama 3's 128,256-token vocabulary and 512 tokens, about 1 GiB and 200 ms of a CPU step.

What ``ChunkedCrossEntropy`` does, with lse = log Σ_v exp(z_v) per row:
- forward: per chunk of rows, the chunk upcast to fp32 and its logsumexp; loss = Σ (lse - z_target) over the
  rows that count (target != IGNORE_INDEX), divided by their number for the mean. It keeps the logits (in
  their own dtype), lse (N fp32), the targets and the count.
- backward: per chunk of rows, softmax = exp(z - lse) in fp32, minus 1 at the target, times the incoming
  gradient (and 1/count for the mean; 0 for rows that do not count), written into the gradient in the logits'
  dtype. The fp32 temporaries are a chunk's size (about CHUNK_ELEMENTS values), never (N, V).

With ``overwrite_logits`` (``minigpt.train``'s losses, whose logits nothing else reads) the backward writes the
gradient over the bf16 logits instead of into a new (N, V) tensor: at Llama 3's vocabulary and 512 tokens that is
131 MB less to allocate and fault in every step (51-300 ms of page faults on the AVX512-BF16 machine of
benchmarks/results, against 31 ms for the gradient itself). Their version counter moves, so an autograd node
that saved the same logits raises instead of reading gradients. fp32 logits of at least FP32_CHUNKED_MIN_VALUES
values take the same path with ``overwrite_logits``, the softmax computed in place over each chunk: where
``F.cross_entropy`` keeps an (N, V) fp32 log-softmax and makes two more (N, V) fp32 gradients (at Llama 3's
vocabulary and 512 tokens 790 MB, and 440 ms of a CPU step in log-softmax and its backward, most of it page
faults, on the AMX Xeon of benchmarks/results), nothing (N, V) is made beyond the logits. Smaller fp32 logits
(MiniGPT's, the labs') keep ``F.cross_entropy``'s exact arithmetic; the two agree to rounding.

bf16 logits on CPU take ``minigpt.native_loss``'s kernels for both passes (the same arithmetic in C, a row at a
time on threads: no fp32 chunk at all); at Llama 3's vocabulary and 512 tokens the loss's forward and backward
took 29 ms against 104 ms as the PyTorch ops above on the machine of benchmarks/RESULTS.md. Without a C compiler
(or with MINIQUANT_NATIVE=0), and for fp16 or CUDA, the PyTorch ops run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native_loss

IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)
# logit values upcast to fp32 at a time, by device type: on CPU 2 MiB, which stays in cache (larger chunks
# measured slower: 140 ms at 4 rows of 128,256 against 150-180 ms at 16-65 rows); on an accelerator 64 MiB, so
# that kernel launches do not dominate
CHUNK_ELEMENTS = {"cpu": 1 << 19, "accelerator": 1 << 24}
REDUCTIONS = ("mean", "sum")
# fp32 logits of at least this many values (64 MiB) go through ChunkedCrossEntropy when their gradient may
# overwrite them: Llama 3 or GPT-2 at 512 tokens, not MiniGPT (the planner asks fp32_loss_chunked too)
FP32_CHUNKED_MIN_VALUES = 1 << 24


def fp32_loss_chunked(rows: int, vocab: int) -> bool:
    """Whether a training loss (overwrite_logits) over (rows, vocab) fp32 logits runs chunked and in place."""
    return rows * vocab >= FP32_CHUNKED_MIN_VALUES


def chunk_rows(vocab: int, device_type: str = "cpu") -> int:
    """Rows of logits that ChunkedCrossEntropy upcasts at a time on a device of that type (at least 1)."""
    return max(1, CHUNK_ELEMENTS["cpu" if device_type == "cpu" else "accelerator"] // vocab)


def _native_for(logits: torch.Tensor) -> native_loss.LossKernels | None:
    """minigpt.native_loss's kernels when they take these logits (bf16 on CPU) and are built, else None."""
    return native_loss.kernels() if native_loss.LossKernels.fits(logits) else None


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (N, V) bf16/fp16 logits (or fp32 ones it may overwrite) against (N,) targets, computed in
    fp32 chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, mean: bool, overwrite: bool = False) -> torch.Tensor:
        n, vocab = logits.shape
        if logits.dtype == torch.float32 and not overwrite:  # its backward computes over fp32 logits in place
            raise ValueError("fp32 logits go to F.cross_entropy unless their gradient may overwrite them")
        native = _native_for(logits)
        if native is not None:  # one pass of C per row for the maximum, one for the sum (minigpt.native_loss)
            lse = native.logsumexp(logits)
        else:
            rows = chunk_rows(vocab, logits.device.type)
            lse = torch.empty(n, dtype=torch.float32, device=logits.device)
            for i in range(0, n, rows):
                lse[i:i + rows] = torch.logsumexp(logits[i:i + rows].float(), dim=-1)
        counts = targets != IGNORE_INDEX
        picked = logits.gather(1, torch.where(counts, targets, 0)[:, None]).squeeze(1).float()  # z_target
        total_weight = counts.sum(dtype=torch.float32)
        loss = torch.where(counts, lse - picked, 0.0).sum()
        ctx.mean, ctx.overwrite = mean, overwrite
        ctx.save_for_backward(logits, targets, lse, total_weight)
        return loss / total_weight if mean else loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse, total_weight = ctx.saved_tensors
        n, vocab = logits.shape
        counts = targets != IGNORE_INDEX
        row_scale = torch.where(counts, grad / total_weight if ctx.mean else grad, 0.0)  # (N,) fp32
        out = None
        if ctx.overwrite:  # the gradient over the logits, read no more; another node that saved them now raises
            out = logits
            torch.autograd.graph.increment_version(logits)
        native = _native_for(logits)
        if native is not None:  # each gradient value computed and written once, in bf16
            out = native.softmax_grad(logits, lse, torch.where(counts, targets, -1), row_scale, out=out)
            return out, None, None, None
        picked = torch.where(counts, targets, 0)[:, None]
        minus_one = torch.full((1, 1), -1.0, dtype=torch.float32, device=logits.device).expand(n, 1)
        out = torch.empty_like(logits) if out is None else out  # each chunk read before it is written
        in_place = out is logits and logits.dtype == torch.float32  # fp32: the softmax computed over the chunk itself
        rows = chunk_rows(vocab, logits.device.type)
        for i in range(0, n, rows):
            j = min(i + rows, n)
            p = logits[i:j] if in_place else logits[i:j].float()
            p.sub_(lse[i:j, None]).exp_()  # softmax, fp32
            p.scatter_add_(1, picked[i:j], minus_one[i:j])  # - one-hot(target)
            p.mul_(row_scale[i:j, None])
            if not in_place:
                out[i:j] = p
        return out, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", *,
                  overwrite_logits: bool = False) -> torch.Tensor:
    """Cross-entropy of logits (..., V) against targets (...) (IGNORE_INDEX does not count), as an fp32 scalar
    (fp64 for fp64 logits): `reduction` "mean" (over the targets that count; NaN when none does, as
    F.cross_entropy) or "sum". With `overwrite_logits`, bf16 and fp16 logits (and their flat view), and fp32 ones
    of at least FP32_CHUNKED_MIN_VALUES values, hold the gradient after the backward: for a caller that reads them
    no more."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    flat, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    if flat.size(0) != flat_targets.numel():
        raise ValueError(f"logits of shape {tuple(logits.shape)} need {flat.size(0)} targets, got shape "
                         f"{tuple(targets.shape)}")
    chunked_fp32 = logits.dtype == torch.float32 and overwrite_logits and fp32_loss_chunked(*flat.shape)
    if logits.dtype in (torch.float32, torch.float64) and not chunked_fp32:
        return F.cross_entropy(flat, flat_targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    return ChunkedCrossEntropy.apply(flat, flat_targets, reduction == "mean", overwrite_logits)

"""Exact bytes of the live tensors a model and its optimizer hold, by bucket, and the process RSS.

    account(model, optimizer)  ->  {"weights": ..., "grads": ..., "optimizer": ..., "total": ...}

- weights: every parameter and buffer of the model: float weights, quantized codes and their scales,
  biases, LoRA factors (a tied weight is one tensor and counts once);
- grads: the ``.grad`` of the parameters (None counts nothing);
- optimizer: every tensor in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq and a 0-d ``step``).

Bytes are counted per storage: tensors sharing memory (tied weights, views) count once, in the first
bucket that holds them, in the order above. Activations are not here: between steps autograd has
freed them. The measured RSS (resident set size, psutil) is the whole process: Python, libraries,
allocator caches and all, so compare two readings of one process, not a reading with a tensor count.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from minigpt.train import adamw, train_step

BUCKETS = ("weights", "grads", "optimizer")


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors`; `seen` (updated) skips storages counted before."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key[2] == 0 and key[3] == 0:  # an empty tensor holds no memory
            continue
        if key not in seen:
            seen.add(key)
            total += key[3]
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def account(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of weights (parameters + buffers), grads and optimizer state, and their total."""
    seen: set = set()
    out = {
        "weights": storage_bytes([*model.parameters(), *model.buffers()], seen),
        "grads": storage_bytes([p.grad for p in model.parameters() if p.grad is not None], seen),
        "optimizer": storage_bytes(optimizer_tensors(optimizer), seen),
    }
    out["total"] = sum(out[b] for b in BUCKETS)
    return out


def weight_breakdown(model: nn.Module) -> dict[str, int]:
    """The weights bucket split: trainable parameters, quantized weights (codes + scales), other frozen tensors."""
    seen: set = set()
    quantized = [t for m in model.modules() if callable(getattr(m, "quantized_tensors", None))
                 for t in m.quantized_tensors()]
    out = {
        "trainable": storage_bytes([p for p in model.parameters() if p.requires_grad], seen),
        "quantized": storage_bytes(quantized, seen),
        "frozen": storage_bytes([*model.parameters(), *model.buffers()], seen),
    }
    out["total"] = out["trainable"] + out["quantized"] + out["frozen"]
    return out


def process_rss_bytes() -> int:
    """Resident set size of this process, in bytes (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss


def cuda_allocated_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes the CUDA caching allocator has handed out on `device`, or None without CUDA."""
    return torch.cuda.memory_allocated(device) if torch.cuda.is_available() else None


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int | None]:
    """account() plus the process RSS (and CUDA allocated bytes when CUDA is present), at this moment."""
    return {**account(model, optimizer), "rss": process_rss_bytes(), "cuda_allocated": cuda_allocated_bytes()}


def measure_training(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn,
                     lr: float = 1e-3) -> dict:
    """Snapshots after building and after one AdamW step per batch (weights + grads + optimizer state).

    `loss_fn(model, x, y)` returns a scalar loss; a non-finite loss raises FloatingPointError. The grads
    of the last step are left in place, so "after_steps" holds all three buckets, as mid-training does.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    built = snapshot(model)
    opt = adamw(params, lr)
    losses = []
    for x, y in batches:  # minigpt.train's step, without clipping
        loss, problem = train_step(model, opt, params, [(x, y)], clip=0.0, loss_fn=loss_fn)
        if problem is not None:
            raise FloatingPointError(f"{problem} at step {len(losses) + 1}")
        losses.append(loss.item())
    return {"after_build": built, "after_steps": snapshot(model, opt), "steps": len(losses), "losses": losses}

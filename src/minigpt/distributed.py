"""Data parallel training with PyTorch's own engine: torchrun + torch.distributed + DistributedDataParallel.

    torchrun --nproc-per-node 2 -m minituner finetune --base artifacts/base --out runs/ddp --batch-size 32

torchrun starts N processes and sets RANK, LOCAL_RANK and WORLD_SIZE; ``init_from_env`` joins them in
one process group (gloo on CPU, nccl on CUDA). The training loop then:

- draws the *global* batch of ``batch_size`` windows from the same seeded generator on every rank and
  keeps rank r's contiguous slice of ``batch_size / N`` rows (``shard``), so the N processes together
  see exactly the batch one process would, and the generator's state (the data position) stays equal
  on every rank, which makes checkpoints rank-independent;
- runs the forward and backward through ``DistributedDataParallel``, which averages the gradients of
  the parameters that require grad, and only those: under LoRA the adapters, never the frozen base
  (DDP registers its all-reduce hooks on trainable parameters only). The mean of the ranks' mean losses
  over equal shards is the global batch's mean loss, so the averaged gradient is one process's gradient;
- reports and checks the loss averaged over ranks (``mean_across_ranks``), so every rank takes the same
  decision on a non-finite loss and the logged loss is the global batch's;
- lets rank 0 alone write metrics, checkpoints, plots, adapters and manifests (``is_writer``).

Without torchrun (WORLD_SIZE unset or 1) every function here is the single-process identity.
"""
from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import InputError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_writer() -> bool:
    """Rank 0 (or a single process) writes files and prints progress."""
    return rank() == 0


def local_rank() -> int | None:
    """LOCAL_RANK from torchrun (the GPU index on this machine), or None outside torchrun."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else None


def init_from_env(device: torch.device) -> bool:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); False when not launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or is_distributed():
        return False
    if not dist.is_available():
        raise InputError("this PyTorch build has no torch.distributed; run a single process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def shutdown() -> None:
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def check_batch(batch_size: int) -> None:
    n = world_size()
    if batch_size % n:
        raise InputError(f"--batch-size {batch_size} is the global batch and must divide evenly over {n} processes")


def shard(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of a global batch: rows [r·B/N, (r+1)·B/N) of x and y, each (B, T)."""
    n = world_size()
    if n == 1:
        return x, y
    per = x.size(0) // n
    rows = slice(rank() * per, (rank() + 1) * per)
    return x[rows], y[rows]  # (B/N, T) each


def mean_across_ranks(t: torch.Tensor) -> torch.Tensor:
    """The mean of a (detached) tensor over the ranks; the tensor itself in a single process."""
    if not is_distributed():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / world_size()


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel over `model` when distributed (it syncs the grads of trainable parameters only)."""
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    # buffers (e.g. NF4 codes) are frozen and equal on every rank: no re-broadcast before each forward
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)

"""Device selection and bf16 autocast: CPU by default, CUDA when asked for (or found, with ``auto``)."""
from __future__ import annotations

import contextlib

import torch

from .errors import InputError

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16-autocast")  # weights, grads and Adam stay fp32 in both; autocast runs matmuls in bf16


def resolve_device(name: str = "auto", local_rank: int | None = None) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a GPU is an InputError. With local_rank, cuda:<rank>."""
    if name not in DEVICES:
        raise InputError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        index = 0 if local_rank is None else local_rank
        if index >= torch.cuda.device_count():
            raise InputError(f"local rank {index} has no GPU: only {torch.cuda.device_count()} visible")
        return torch.device("cuda", index)
    return torch.device("cpu")


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16-autocast" and device.type != "cuda":
        raise InputError("bf16 autocast is a CUDA path; on CPU train in fp32 (--precision fp32)")
    if precision == "bf16-autocast" and not torch.cuda.is_bf16_supported():
        raise InputError("this GPU does not support bf16; use --precision fp32")


def autocast(device: torch.device, precision: str = "fp32") -> contextlib.AbstractContextManager:
    """A context that runs the forward in bf16 autocast on CUDA for "bf16-autocast", and does nothing otherwise."""
    if precision == "bf16-autocast" and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()

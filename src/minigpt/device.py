"""Device selection and the precision check: CPU by default, CUDA when asked for (or found, with ``auto``)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .bf16_support import Bf16Support, check_bf16
from .errors import InputError

DEVICES = ("auto", "cpu", "cuda")
# fp32: every tensor fp32. bf16: the frozen base stored and multiplied in bf16, LoRA masters, norms, softmax,
# loss, grads and Adam fp32 (minituner.precision builds it; on CPU only with bf16 units, see bf16_support)
PRECISIONS = ("fp32", "bf16")


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


def check_precision(precision: str, device: torch.device | str = "cpu", allow_slow_bf16: bool = False,
                    flags: Iterable[str] | None = None) -> Bf16Support | None:
    """An unknown precision is an InputError; "bf16" where it would run slower than fp32 (a CPU without bf16
    units, a GPU without bf16) is refused in one line unless allow_slow_bf16. Returns what check_bf16 found."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return check_bf16(device, allow_slow_bf16, flags) if precision == "bf16" else None

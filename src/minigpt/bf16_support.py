"""Does this device run bf16 fast? A pure check on the CPU's feature flags, and a one-line refusal when not.

On a CPU, bf16 products are fast only with bf16 units: AVX512-BF16 (``avx512_bf16``: a bf16 dot product
per fp32 lane) or AMX (``amx_bf16``: tile matrix units), as /proc/cpuinfo names them on x86, or Arm's BF16
extension (``bf16`` among the Features). Without them PyTorch still runs bf16, through conversions to fp32,
slower than fp32 itself (pytorch #86270): we refuse rather than run slower, unless the user insists.
``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is not the test: it is true on any AVX-512 CPU, units or not.
On CUDA the test is ``torch.cuda.is_bf16_supported()``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from minikernels.build import cpu_flag_set, parse_cpu_flags  # noqa: F401 (parse_cpu_flags: also this module's API)

from .errors import InputError

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX512-BF16, Arm BF16 (Features)
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags, read once per process (the planner asks per regime); empty when
    /proc/cpuinfo cannot be read (not Linux)."""
    return cpu_flag_set(CPUINFO)


def cpu_bf16_units(flags: Iterable[str]) -> tuple[str, ...]:
    """The bf16 units these flags name, in the order of BF16_CPU_FLAGS (empty: none)."""
    flags = set(flags)
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


@dataclass(frozen=True)
class Bf16Support:
    fast: bool  # bf16 products run faster than fp32 here
    units: tuple[str, ...]  # the CPU's bf16 units (empty on CUDA or without them)
    reason: str  # one line: what was found

    def to_dict(self) -> dict:
        return {"fast": self.fast, "units": list(self.units), "reason": self.reason}


def bf16_support(device: torch.device | str = "cpu", flags: Iterable[str] | None = None,
                 cuda_bf16: bool | None = None) -> Bf16Support:
    """Whether `device` has bf16 units. `flags` (CPU) and `cuda_bf16` (CUDA) default to this machine's."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        return Bf16Support(ok, (), "this GPU supports bf16" if ok else "this GPU does not support bf16")
    if device.type != "cpu":
        return Bf16Support(False, (), f"bf16 speed on {device.type} is not known here")
    units = cpu_bf16_units(cpu_flags() if flags is None else flags)
    if units:
        return Bf16Support(True, units, f"this CPU has bf16 units ({', '.join(units)})")
    return Bf16Support(False, (), "this CPU has no bf16 units (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo)")


def check_bf16(device: torch.device | str = "cpu", allow_slow_bf16: bool = False, flags: Iterable[str] | None = None,
               cuda_bf16: bool | None = None) -> Bf16Support:
    """Refuse bf16 where it would be slower than fp32 (InputError, one line), unless allow_slow_bf16.

    Returns the support found; when allowed although slow, its `fast` is False and the caller may warn."""
    s = bf16_support(device, flags, cuda_bf16)
    if not s.fast and not allow_slow_bf16:
        if torch.device(device).type == "cpu":
            raise InputError(f"--precision bf16: {s.reason}, so bf16 would run slower than fp32; "
                             "use --precision fp32 (or --allow-slow-bf16 to insist)")
        raise InputError(f"--precision bf16: {s.reason}; use --precision fp32")
    return s

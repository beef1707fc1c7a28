"""Phase 26: symmetric per-group integer quantization (int8, int4), small pure functions.

Groups run along the last dimension (a Linear weight's input features), `group_size` values each;
when the last dimension is not a multiple of `group_size` the last group of every row is shorter.

    scale = absmax(group) / (2^(bits-1) - 1)        (127 for int8, 7 for int4; -2^(bits-1) is unused)
    q     = clamp(round(w / scale), -qmax, qmax)     (round half to even, torch.round)
    w'    = q * scale                                 |w - w'| <= scale / 2

An all-zero group has scale 0 and dequantizes to zeros. int4 codes are stored two per byte
(q + 8 in [1, 15], first value in the high nibble), so storage is exact: ceil(n/2) bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

from .errors import QuantizationError
from .packing import pack_nibbles, unpack_nibbles

SUPPORTED_BITS = (8, 4)
CHUNK_ELEMENTS = 1 << 20  # values processed per chunk of rows, to bound the extra memory


def qmax(bits: int) -> int:
    """Largest code magnitude of a symmetric signed `bits`-bit integer: 127 for int8, 7 for int4."""
    return 2 ** (bits - 1) - 1


@dataclass
class IntQuantized:
    """A tensor quantized symmetric per group; rows = numel / shape[-1]."""

    qweight: Tensor  # int8: (rows, cols) int8 codes; int4: (ceil(rows*cols/2),) uint8, two codes per byte
    scales: Tensor  # (rows, ceil(cols/group_size)) float32
    shape: torch.Size  # the original shape
    dtype: torch.dtype  # the original dtype (default dequantization dtype)
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        """Exact bytes of the codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def _check(w: Tensor, bits: int, group_size: int) -> None:
    if not isinstance(w, Tensor) or not w.is_floating_point():
        raise QuantizationError(f"expected a floating-point tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise QuantizationError(f"group_size must be a positive integer, got {group_size!r}")
    if w.dim() == 0 or w.numel() == 0:
        raise QuantizationError(f"cannot quantize a tensor of shape {tuple(w.shape)}")


def _grouped(rows: Tensor, group_size: int) -> Tensor:
    """(r, cols) -> (r, groups, group_size) float32, zero-padded (zeros leave absmax unchanged)."""
    cols = rows.shape[1]
    groups = -(-cols // group_size)
    padded = torch.nn.functional.pad(rows.float(), (0, groups * group_size - cols))
    return padded.view(rows.shape[0], groups, group_size)


def quantize_symmetric_per_group(w: Tensor, bits: int, group_size: int) -> IntQuantized:
    """Quantize w to signed `bits`-bit integers with one float32 scale per group of the last dimension."""
    _check(w, bits, group_size)
    cols = w.shape[-1]
    flat = w.detach().reshape(-1, cols)  # (rows, cols)
    rows = flat.shape[0]
    groups = -(-cols // group_size)
    codes = torch.empty(rows, cols, dtype=torch.int8, device=w.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=w.device)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        g = _grouped(flat[r0 : r0 + step], group_size)  # (r, groups, group_size)
        absmax = g.abs().amax(dim=-1)  # (r, groups)
        if not torch.isfinite(absmax).all():
            raise QuantizationError("cannot quantize a tensor with NaN or Inf values")
        scale = absmax / qmax(bits)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group: codes 0
        q = torch.round(g / safe[..., None]).clamp_(-qmax(bits), qmax(bits))
        codes[r0 : r0 + step] = q.view(q.shape[0], -1)[:, :cols].to(torch.int8)
        scales[r0 : r0 + step] = scale
    qweight = codes if bits == 8 else pack_nibbles((codes.reshape(-1) + 8).to(torch.uint8))
    return IntQuantized(qweight, scales, w.shape, w.dtype, bits, group_size)


def unpack_int_codes(q: IntQuantized) -> Tensor:
    """The signed codes as a (rows, cols) int8 tensor."""
    cols = q.shape[-1]
    if q.bits == 8:
        return q.qweight.view(-1, cols)
    n = prod(q.shape)
    return (unpack_nibbles(q.qweight, n).to(torch.int8) - 8).view(-1, cols)


def dequantize_symmetric_per_group(q: IntQuantized, dtype: torch.dtype | None = None) -> Tensor:
    """IntQuantized -> tensor of q.shape: code x group scale in float32, then cast to dtype (default q.dtype)."""
    codes = unpack_int_codes(q)  # (rows, cols)
    rows, cols = codes.shape
    groups = q.scales.shape[-1]
    if q.scales.shape != (rows, -(-cols // q.group_size)):
        raise QuantizationError(f"scales of shape {tuple(q.scales.shape)} do not fit codes of shape {(rows, cols)}")
    out = torch.empty(rows, cols, dtype=dtype or q.dtype, device=codes.device)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        c = _grouped(codes[r0 : r0 + step], q.group_size)  # (r, groups, group_size) float32
        w = c * q.scales[r0 : r0 + step, :, None]
        out[r0 : r0 + step] = w.view(w.shape[0], groups * q.group_size)[:, :cols]
    return out.view(q.shape)

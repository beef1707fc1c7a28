"""Two 4-bit codes per byte, first code in the high nibble (bitsandbytes' layout)."""
from __future__ import annotations

import torch
from torch import Tensor


def pack_nibbles(codes: Tensor, pad: int = 0) -> Tensor:
    """(n,) integer codes in [0, 15] -> (ceil(n/2),) uint8; an odd count gets `pad` in the last low nibble."""
    if not 0 <= pad <= 15:
        raise ValueError(f"pad code must be in [0, 15], got {pad}")
    codes = codes.reshape(-1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), pad)])
    return (codes[0::2] << 4) | codes[1::2]  # (ceil(n/2),)


def unpack_nibbles(packed: Tensor, n: int) -> Tensor:
    """(m,) uint8 -> the first n codes as (n,) uint8, high nibble first; needs n <= 2m."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if not 0 <= n <= 2 * packed.numel():
        raise ValueError(f"cannot unpack {n} codes from {packed.numel()} bytes")
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1)  # (m, 2)
    return codes.reshape(-1)[:n]

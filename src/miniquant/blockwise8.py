"""8-bit blockwise quantization with the dynamic code: what double quantization uses for NF4's absmax.

Both the code table and the rounding follow bitsandbytes 0.50.2 on CPU so that our double-quantized
statistics are byte-identical to `quantize_4bit(..., compress_statistics=True)`:

- The code is Dettmers' signed "dynamic" 8-bit type (`create_dynamic_map(signed=True,
  max_exponent_bits=7, total_bits=8)`): 256 sorted values in [-0.993, 1.0], a decade-spaced
  exponent and a linear fraction, plus 0 and 1.
- The CPU kernel does not search for the nearest code. It scales each value by 1/absmax (a
  reciprocal, then a multiply), clamps to [-1, 1], snaps it to a grid of 65536 evenly spaced points
  (index = trunc((v + 1) * 0.5 * 65535 + 0.5)), and reads the code index of that grid point from a
  table holding, for each point, the nearest code (ties to the lower code). Near a midpoint the grid
  snap can pick the farther code; `tests/miniquant` measures how often that happens. An all-zero
  block stores absmax 0 and code index 0.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

GRID_POINTS = 65536  # resolution of bitsandbytes' CPU lookup grid over [-1, 1]


@lru_cache(maxsize=None)
def _dynamic_code_cpu() -> Tensor:
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        fraction_items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0  # float32, as bitsandbytes computes them
        decade = 10 ** (-(max_exponent_bits - 1) + i)
        data += (decade * means).tolist()
        data += (-decade * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def dynamic_code_table(device: torch.device | str = "cpu") -> Tensor:
    """The 256 values of the signed dynamic 8-bit code, sorted, float32."""
    return _dynamic_code_cpu().to(device)


@lru_cache(maxsize=None)
def _grid_to_code_cpu() -> Tensor:
    code = _dynamic_code_cpu()
    midpoints = 0.5 * (code[:-1] + code[1:])  # (255,) float32
    i = torch.arange(GRID_POINTS, dtype=torch.float32)
    grid = -1.0 + (2.0 * i) / (GRID_POINTS - 1)  # float32, same operation order as the C++ kernel
    # code index = number of midpoints strictly below the grid point (ties go to the lower code)
    return torch.bucketize(grid, midpoints).to(torch.uint8)  # (65536,)


def grid_to_code_table(device: torch.device | str = "cpu") -> Tensor:
    """(65536,) uint8: for each grid point in [-1, 1], the index of the nearest dynamic code."""
    return _grid_to_code_cpu().to(device)


def quantize_blockwise_8bit(x: Tensor, blocksize: int = 256) -> tuple[Tensor, Tensor]:
    """1-D float32 x -> (codes (n,) uint8, absmax (ceil(n/blocksize),) float32); partial last block allowed."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"expected a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if blocksize <= 0:
        raise ValueError(f"blocksize must be positive, got {blocksize}")
    n = x.numel()
    blocks = -(-n // blocksize)
    padded = torch.nn.functional.pad(x, (0, blocks * blocksize - n)).view(blocks, blocksize)  # zeros leave absmax alone
    absmax = padded.abs().amax(dim=1)  # (blocks,)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))  # all-zero block -> every value 0
    v = (padded * inv[:, None]).clamp(-1.0, 1.0)  # (blocks, blocksize)
    idx = ((v + 1.0) * 0.5 * (GRID_POINTS - 1) + 0.5).to(torch.int64)  # trunc toward zero, v + 1 >= 0
    codes = grid_to_code_table(x.device)[idx]
    codes[absmax == 0] = 0  # bitsandbytes writes index 0 for an all-zero block
    return codes.reshape(-1)[:n].contiguous(), absmax


def dequantize_blockwise_8bit(codes: Tensor, absmax: Tensor, blocksize: int = 256) -> Tensor:
    """codes (n,) uint8, absmax (ceil(n/blocksize),) float32 -> (n,) float32: code value x block absmax."""
    n = codes.numel()
    if absmax.numel() != -(-n // blocksize):
        need = -(-n // blocksize)
        raise ValueError(f"{n} codes in blocks of {blocksize} need {need} absmax values, got {absmax.numel()}")
    values = dynamic_code_table(codes.device)[codes.reshape(-1).long()]  # (n,) float32
    scale = absmax.float().repeat_interleave(blocksize)[:n]
    return values * scale

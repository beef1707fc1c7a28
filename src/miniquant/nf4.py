"""NF4 (4-bit NormalFloat, QLoRA): small pure functions, byte-identical to bitsandbytes.

`quantize_nf4(w, blocksize=64)` gives the same `.packed` bytes and `.absmax` floats as
`bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")` (0.50.2, CPU) for
float32, bfloat16 and float16 inputs of any shape. The recipe, step by step:

1. Flatten w in row-major order and cast to float32 (exact for bf16/fp16).
2. Cut it into blocks of `blocksize` values; the last block may be partial. absmax = max |w| per block.
3. Scale to [-1, 1]. Full blocks are multiplied by the float32 reciprocal 1/max(absmax, 1e-38); the
   partial last block is divided by max(absmax, 1e-38). bitsandbytes does exactly this, and x*(1/a)
   and x/a differ in the last bit often enough to change codes, so we mirror both. Clamp to [-1, 1].
4. Nearest code: index = number of midpoints between neighbouring codes that lie strictly below the
   value (bitsandbytes uses `torch.bucketize`, right=False), so a value exactly on a midpoint takes
   the lower code. We compute the same count with a small lookup table (see `nearest_nf4_code`).
5. Pack two codes per byte, first in the high nibble. An odd count is padded with code 7 (the value
   0.0), which is what bitsandbytes' zero padding quantizes to.

Dequantization is code value x block absmax in float32, then a cast to the output dtype; it equals
bitsandbytes' pure-PyTorch default backend (its native CPU kernel in 0.50.2 is wrong when blocks
straddle rows; see tests/miniquant/test_nf4_bnb.py).

Two paths compute the same bytes. On CPU tensors of at least `NATIVE_MIN_ELEMENTS` values the whole
blocks go through one native kernel each way (native.py: C compiled on first use, threads over blocks):
quantization reads w once and writes only its outputs, dequantization writes its output once. Everything
else (small tensors, the partial last block, other devices, no C compiler, or MINIQUANT_NATIVE=0) takes
the eager PyTorch path, which works in chunks of whole blocks (`CHUNK_ELEMENTS` values at a time), so its
extra memory is bounded by a few chunk-sized float32 buffers whatever the tensor's size.
tests/miniquant/test_nf4_native.py checks that both paths give the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from torch import Tensor

from .blockwise8 import dequantize_blockwise_8bit, quantize_blockwise_8bit
from . import native
from .errors import QuantizationError
from .packing import pack_nibbles

NF4_OFFSET = 0.9677083  # outermost quantile; norm.ppf(0.9677083) ~ 1.848 sets the code range (bitsandbytes)
ABSMAX_FLOOR = 1e-38  # bitsandbytes clamps absmax to this before dividing: an all-zero block scales to 0
DOUBLE_QUANT_BLOCKSIZE = 256  # block size for quantizing the absmax values to 8 bits (QLoRA)
CHUNK_ELEMENTS = 1 << 20  # values processed per chunk (rounded to whole, even-length runs of blocks)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NF4_ZERO_CODE = 7  # index of the value 0.0 in the code table
NATIVE_MIN_ELEMENTS = 1 << 14  # smaller tensors stay eager (and never trigger the one-off native build)


@lru_cache(maxsize=None)
def _nf4_code_cpu() -> Tensor:
    # 8 positive and 7 negative normal quantiles plus an exact zero, as in QLoRA / bitsandbytes'
    # create_normal_map(offset=0.9677083, use_extra_value=True); ndtri is the inverse normal CDF.
    q_pos = torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double()  # float32 linspace, like bitsandbytes
    q_neg = torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double()
    values = torch.cat([torch.special.ndtri(q_pos), torch.zeros(1, dtype=torch.float64), -torch.special.ndtri(q_neg)])
    values = values.float().sort().values
    return values / values.max()  # (16,) in [-1, 1], codes[7] == 0.0, codes[15] == 1.0


def nf4_code_table(device: torch.device | str = "cpu") -> Tensor:
    """The 16 NF4 values, sorted, float32: index i is the 4-bit code i."""
    return _nf4_code_cpu().to(device)


def nf4_midpoints(device: torch.device | str = "cpu") -> Tensor:
    """(15,) float32 decision thresholds: midpoints between neighbouring NF4 values."""
    code = nf4_code_table(device)
    return (code[:-1] + code[1:]) / 2


def block_absmax(flat: Tensor, blocksize: int) -> Tensor:
    """(n,) float32 -> (ceil(n/blocksize),) float32 max |value| per block, partial last block allowed."""
    n = flat.numel()
    full = n - n % blocksize
    absmax = flat[:full].view(-1, blocksize).abs().amax(dim=1)  # (full/blocksize,)
    if full < n:
        absmax = torch.cat([absmax, flat[full:].abs().amax().reshape(1)])
    return absmax


def scale_blocks(flat: Tensor, absmax: Tensor, blocksize: int) -> Tensor:
    """(n,) float32 values / their block's absmax, clamped to [-1, 1] (bitsandbytes' exact arithmetic)."""
    n = flat.numel()
    full = n - n % blocksize
    floor = absmax.clamp(min=ABSMAX_FLOOR)
    scaled = (flat[:full].view(-1, blocksize) * (1.0 / floor[: full // blocksize, None])).reshape(-1)
    if full < n:
        scaled = torch.cat([scaled, flat[full:] / floor[-1]])  # the partial block divides
    return scaled.clamp(-1.0, 1.0)


def nearest_nf4_code_reference(scaled: Tensor) -> Tensor:
    """Values in [-1, 1] -> NF4 code indices: the number of midpoints strictly below each value.

    A value exactly on a midpoint takes the lower code. This is bitsandbytes' rule (bucketize over the
    midpoints); `nearest_nf4_code` computes the same indices faster.
    """
    return torch.bucketize(scaled, nf4_midpoints(scaled.device)).to(torch.uint8)


LOOKUP_CELLS_PER_UNIT = 64  # [-1, 1] is cut into 128 cells, each narrower than any gap between midpoints
_LOOKUP_MARGIN = 1e-4  # widens each cell on both sides, far beyond float32 rounding of (v + 1) * 64


@lru_cache(maxsize=None)
def _lookup_tables_cpu() -> tuple[Tensor, Tensor]:
    mids = nf4_midpoints().double()
    cells = 2 * LOOKUP_CELLS_PER_UNIT
    below, inside = [], []
    for c in range(cells):
        lo = c / LOOKUP_CELLS_PER_UNIT - 1 - _LOOKUP_MARGIN
        hi = (c + 1) / LOOKUP_CELLS_PER_UNIT - 1 + _LOOKUP_MARGIN
        in_cell = mids[(mids >= lo) & (mids <= hi)]
        assert in_cell.numel() <= 1, "cells must be narrower than the gaps between NF4 midpoints"
        below.append(int((mids < lo).sum()))
        inside.append(float(in_cell[0]) if in_cell.numel() else float("inf"))
    # `inside` holds float32 midpoints exactly (they came from float32 values via float64)
    return torch.tensor(below, dtype=torch.uint8), torch.tensor(inside, dtype=torch.float32)


def nearest_nf4_code(scaled: Tensor) -> Tensor:
    """Values in [-1, 1] -> NF4 code indices (uint8), identical to `nearest_nf4_code_reference`.

    A two-table lookup instead of a binary search: the cell of v (128 equal cells over [-1, 1], each
    widened by a margin) holds at most one midpoint m, so the count of midpoints below v is
    (midpoints below the widened cell) + (v > m). About ten times faster than torch.bucketize on CPU.
    """
    below, inside = (t.to(scaled.device) for t in _lookup_tables_cpu())
    cell = ((scaled + 1.0) * LOOKUP_CELLS_PER_UNIT).long().clamp_(0, 2 * LOOKUP_CELLS_PER_UNIT - 1)
    return torch.take(below, cell).add_(scaled > torch.take(inside, cell))


@dataclass
class NF4Tensor:
    """A tensor quantized to NF4, laid out like bitsandbytes' packed weight and QuantState."""

    packed: Tensor  # (ceil(n/2),) uint8, element 2i in the high nibble of byte i
    absmax: Tensor  # (ceil(n/blocksize),) float32; uint8 codes of the dynamic type when double-quantized
    shape: torch.Size  # the original shape
    dtype: torch.dtype  # the original dtype (default dequantization dtype)
    blocksize: int
    absmax_scale: Tensor | None = None  # double quant: (ceil(blocks/256),) float32 absmax of the absmax
    absmax_offset: Tensor | None = None  # double quant: () float32 mean subtracted before quantizing

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact bytes of the tensors held (the constant code tables are not counted: they are not stored)."""
        extra = [self.absmax_scale, self.absmax_offset]
        return sum(t.numel() * t.element_size() for t in [self.packed, self.absmax, *extra] if t is not None)

    def block_scales(self) -> Tensor:
        """(blocks,) float32 absmax per block, undoing double quantization if it was used."""
        if not self.double_quant:
            return self.absmax
        scales = dequantize_blockwise_8bit(self.absmax, self.absmax_scale, DOUBLE_QUANT_BLOCKSIZE)
        return scales + self.absmax_offset


def _check_input(w: Tensor, blocksize: int) -> None:
    if not isinstance(w, Tensor) or w.dtype not in SUPPORTED_DTYPES:
        got = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise QuantizationError(f"NF4 quantizes float32, bfloat16 or float16 tensors, got {got}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize <= 0:
        raise QuantizationError(f"blocksize must be a positive integer, got {blocksize!r}")
    if w.numel() == 0:
        raise QuantizationError("cannot quantize an empty tensor")


def _chunk_elements(blocksize: int) -> int:
    """Chunk length: a whole, even number of blocks, so chunks start on a block and a byte boundary."""
    blocks = max(2, CHUNK_ELEMENTS // blocksize)
    return (blocks + blocks % 2) * blocksize


def _native_for(t: Tensor, numel: int, blocksize: int, dtype: torch.dtype) -> native.NativeKernels | None:
    """The native kernels when they apply: a large enough CPU tensor, an even block size, a supported dtype."""
    if not t.is_cpu or numel < NATIVE_MIN_ELEMENTS or blocksize % 2 or blocksize > 4096:
        return None
    k = native.kernels()
    return k if k is not None and dtype in k.dtypes else None


def quantize_nf4(w: Tensor, blocksize: int = 64, double_quant: bool = False) -> NF4Tensor:
    """Quantize w to NF4 in blocks of `blocksize` values; NaN/Inf input raises QuantizationError."""
    _check_input(w, blocksize)
    flat = w.detach().reshape(-1)  # a view when w is contiguous (a non-contiguous w is copied once)
    n = flat.numel()
    full = n - n % blocksize
    kernels = _native_for(flat, n, blocksize, flat.dtype) if full else None
    if kernels is not None and full == n:  # whole blocks only: the kernel's outputs are the result
        packed, absmax = kernels.quantize(flat.view(-1, blocksize), nf4_midpoints())
        packed = packed.view(-1)
    else:
        packed = torch.empty(-(-n // 2), dtype=torch.uint8, device=w.device)
        absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=w.device)
        done = 0
        if kernels is not None:  # whole blocks native, the partial last block eager
            head_packed, head_absmax = kernels.quantize(flat[:full].view(-1, blocksize), nf4_midpoints())
            packed[: full // 2], absmax[: full // blocksize], done = head_packed.view(-1), head_absmax, full
        _quantize_eager(flat, blocksize, packed, absmax, done)
    if not torch.isfinite(absmax).all():  # amax propagates NaN, so this sees every NaN/Inf
        raise QuantizationError("cannot quantize a tensor with NaN or Inf values")
    q = NF4Tensor(packed=packed, absmax=absmax, shape=w.shape, dtype=w.dtype, blocksize=blocksize)
    return double_quantize(q) if double_quant else q


def _quantize_eager(flat: Tensor, blocksize: int, packed: Tensor, absmax: Tensor, begin: int) -> None:
    """Quantize flat[begin:] (begin on a block boundary) into packed/absmax, chunk by chunk."""
    step = _chunk_elements(blocksize)
    for start in range(begin, flat.numel(), step):
        chunk = flat[start : start + step].float()  # (<= step,)
        chunk_absmax = block_absmax(chunk, blocksize)
        if not torch.isfinite(chunk_absmax).all():  # stop early: the rest would be thrown away
            raise QuantizationError("cannot quantize a tensor with NaN or Inf values")
        codes = nearest_nf4_code(scale_blocks(chunk, chunk_absmax, blocksize))
        absmax[start // blocksize : start // blocksize + chunk_absmax.numel()] = chunk_absmax
        packed[start // 2 : start // 2 + -(-chunk.numel() // 2)] = pack_nibbles(codes, pad=NF4_ZERO_CODE)


def double_quantize(q: NF4Tensor) -> NF4Tensor:
    """Quantize the float32 absmax to 8 bits: subtract its mean, then blockwise dynamic code, blocks of 256."""
    if q.double_quant:
        return q
    offset = q.absmax.mean()  # () float32, the same reduction bitsandbytes calls
    codes, scale = quantize_blockwise_8bit(q.absmax - offset, DOUBLE_QUANT_BLOCKSIZE)
    return NF4Tensor(q.packed, codes, q.shape, q.dtype, q.blocksize, absmax_scale=scale, absmax_offset=offset)


@lru_cache(maxsize=None)
def _byte_values_cpu() -> Tensor:
    """(256, 2) float32: the code values of a byte's high and low nibble, so one lookup decodes a byte."""
    code = _nf4_code_cpu()
    return torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1).contiguous()


def _dequantize_eager(packed: Tensor, count: int, scales: Tensor, blocksize: int) -> Tensor:
    """First `count` values of packed bytes (starting on a block boundary) as code x scale, float32."""
    table = _byte_values_cpu().to(packed.device)
    values = table.index_select(0, packed.int()).view(-1)[:count]  # (count,) float32, a fresh tensor
    full = count - count % blocksize
    values[:full].view(-1, blocksize).mul_(scales[: full // blocksize, None])
    if full < count:
        values[full:].mul_(scales[-1])
    return values


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None,
                   stream: bool = False) -> Tensor:
    """NF4Tensor -> tensor of q.shape: code value x block absmax in float32, then cast to dtype (default q.dtype).

    `out`: an existing contiguous tensor of q.numel values in dtype on q's device to write into (a reused
    workspace: no allocation, no page faults); the result is then `out` viewed as q.shape.
    stream: the native kernel writes with non-temporal stores where it can, for an `out` that other cores'
    caches hold (``native.NativeKernels.dequantize``); the same values either way.
    """
    dtype = dtype or q.dtype
    n, bs, packed = q.numel, q.blocksize, q.packed
    if packed.numel() != -(-n // 2) or q.absmax.numel() != -(-n // bs):
        raise QuantizationError(
            f"NF4 tensor of {n} values in blocks of {bs} needs {-(-n // 2)} bytes and {-(-n // bs)} scales, "
            f"got {packed.numel()} and {q.absmax.numel()}"
        )
    if out is not None and (out.numel() != n or out.dtype != dtype or not out.is_contiguous()
                            or out.get_device() != packed.get_device()):  # (-1 on CPU: no device objects made)
        raise QuantizationError(f"out must be a contiguous {dtype} tensor of {n} values on {packed.device}, "
                                f"got {out.dtype} of {out.numel()} on {out.device}")
    scales = q.block_scales()
    full = n - n % bs
    kernels = _native_for(packed, n, bs, dtype) if full else None
    if kernels is not None and full == n:  # whole blocks, written once (twice per weight in every QLoRA step: kept
        # lean, no slices or copies of the code table)
        return kernels.dequantize(packed.view(-1, bs // 2), scales, _nf4_code_cpu(), dtype,
                                  None if out is None else out.view(-1, bs), stream).view(q.shape)
    if kernels is not None:
        head_out = None if out is None else out.view(-1)[:full].view(-1, bs)
        head = kernels.dequantize(packed[: full // 2].view(-1, bs // 2), scales, _nf4_code_cpu(), dtype, head_out,
                                  stream)
    out = torch.empty(n, dtype=dtype, device=q.packed.device) if out is None else out.view(-1)
    done = 0
    if kernels is not None:  # whole blocks native, the partial last block eager
        if head.data_ptr() != out.data_ptr():
            out[:full] = head.view(-1)
        done = full
    step = _chunk_elements(bs)
    for start in range(done, n, step):
        stop = min(start + step, n)
        chunk = q.packed[start // 2 : -(-stop // 2)]
        out[start:stop] = _dequantize_eager(chunk, stop - start, scales[start // bs : -(-stop // bs)], bs)
    return out.view(q.shape)

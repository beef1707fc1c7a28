"""fp32 compute on a 16-bit checkpoint (bf16 or fp16, as Llama 3, Qwen2.5 and Mistral ship) without upcasting it.

    model = load_base(folder)[0]      # a bf16 checkpoint, read as it is stored
    compute_in_fp32(model)            # what build_for_training does for LoRA and QLoRA in fp32 on CPU

CPUs without bf16 units run bf16 products many times slower than fp32 ones, and an fp32 copy of a 7B model is
28 GB. So the checkpoint's frozen tensors stay as read and only the small ones become fp32 (norms):
- each block Linear becomes an ``UpcastLinear``: every product casts its weight to fp32 into a workspace shared
  by every layer (miniquant's, where NF4 dequantizes) and multiplies there, in forward and again in backward
  for the input's gradient. Nothing fp32 of the weight outlives the product;
- the output head too, but 2,048 rows of its weight at a time (``rows_per_product``, ``chunk_heads``): a chunk
  is never larger than the largest block Linear, so the workspace does not grow for it (Llama 3's 128,256 x 4,096
  head would need 2 GiB), and it stays in cache between its cast and its product (1-2% slower than a head stored
  in fp32 on 2 threads, 5% on one; see HEAD_CHUNK_ROWS). In forward each chunk's logits are copied into the
  (N, V) logits; in backward each chunk's share of the input gradient is added up;
- the token embedding becomes a ``precision.CastEmbedding``: a 16-bit table, fp32 rows out. A tied head and
  embedding keep sharing one 16-bit Parameter.
At Llama-3-8B's shape the embedding and head are 1.05 billion values: 1.96 GiB saved over fp32.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minikernels import fp32_gemm
from miniquant import QuantizedLinear
from miniquant.quantize import DequantLinearFunction, workspace_buffer

from .lora import OUTPUT_HEADS
from .precision import (LOW_BITS, CastEmbedding, embedding_as, linear_as, lora_factor_modules, swap_modules,
                        use_fp32_products)
from .qlora import cast_float_tensors


class UpcastLinear(nn.Linear):
    """A frozen Linear stored in 16 bits (a bf16 or fp16 checkpoint's weight, as read) that computes in fp32.

    Each product casts the weight into a workspace shared by every layer (miniquant's, where NF4 dequantizes)
    and multiplies there, in forward and again in backward (``DequantLinearFunction``: the input's gradient
    only, nothing fp32 kept): the model keeps 16-bit memory and runs fp32 products, which CPUs without bf16
    units run many times faster than bf16 ones. With ``rows_per_product`` set (the output head) the weight is
    cast and multiplied that many output rows at a time (``RowChunkedUpcastFunction``). An input in another
    dtype computes in the weight's dtype."""

    rows_per_product: int | None = None  # None: the whole weight in one product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)  # (..., out)
        x2 = x.reshape(-1, self.in_features)  # (N, in): the Function's output is then a plain (N, out) tensor
        rows = self.rows_per_product
        if rows is None or rows >= self.out_features:
            y = DequantLinearFunction.apply(x2, self.bias, self, self.weight)  # the weight saved: no copy
        else:
            y = RowChunkedUpcastFunction.apply(x2, self.bias, self.weight, rows)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)  # (..., out)

    def dequantize_from(self, tensors: tuple[torch.Tensor, ...], dtype: torch.dtype, transient: bool = False
                        ) -> torch.Tensor:
        """The (out, in) weight in `dtype`: in the shared workspace when `transient` (valid until its next use)."""
        w = tensors[0]
        out = workspace_buffer(w.numel(), dtype, w.device).view(w.shape) if transient else torch.empty_like(w, dtype=dtype)
        return out.copy_(w)

    def input_grad_from(self, tensors: tuple[torch.Tensor, ...], g: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
        """g (N, out)·W -> (N, in), the weight upcast to `dtype` (default g's) in the shared workspace (what
        DequantLinearFunction's backward asks every layer it computes)."""
        return fp32_gemm.input_grad(g, self.dequantize_from(tensors, dtype or g.dtype, transient=True))

    def extra_repr(self) -> str:
        rows = "" if self.rows_per_product is None else f", rows_per_product={self.rows_per_product}"
        return super().extra_repr() + f", weight_dtype={str(self.weight.dtype).removeprefix('torch.')}{rows}"


def _upcast_rows(weight: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """weight[start:start + rows] cast to fp32 in the shared workspace (valid until its next use)."""
    w = weight[start:start + rows]  # (rows, in): a view
    return workspace_buffer(w.numel(), torch.float32, w.device).view(w.shape).copy_(w)


class RowChunkedUpcastFunction(torch.autograd.Function):
    """y = x @ Wᵀ + b for a 16-bit W cast to fp32 `rows` output rows at a time; the gradient for x only.

    forward: per chunk, y[:, chunk] = x @ W[chunk]ᵀ (+ b[chunk]), the chunk's product copied into y.
    backward: grad_x = Σ over chunks grad_y[:, chunk] @ W[chunk], each chunk cast again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor, rows: int) -> torch.Tensor:
        out_features = weight.shape[0]
        y = x.new_empty(x.shape[0], out_features)  # (N, out)
        for start in range(0, out_features, rows):
            w = _upcast_rows(weight, start, rows)  # (rows, in) fp32
            b = None if bias is None else bias[start:start + rows].float()
            y[:, start:start + w.shape[0]] = fp32_gemm.product(x, w, b)  # (N, rows)
        ctx.rows = rows
        ctx.save_for_backward(weight)  # the 16-bit weight: no copy
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            for start in range(0, weight.shape[0], ctx.rows):
                w = _upcast_rows(weight, start, ctx.rows)  # (rows, in) fp32, recomputed
                part = fp32_gemm.input_grad(grad_y[:, start:start + w.shape[0]], w)  # (N, rows) @ (rows, in)
                grad_x = part if grad_x is None else grad_x.add_(part)
        return grad_x, None, None, None


def low_bit_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
    """(path, module) of every nn.Linear with a 16-bit weight but the LoRA factors and those named in `skip`."""
    lora_factors = lora_factor_modules(model)
    return [(path, m) for path, m in model.named_modules()
            if type(m) is nn.Linear and id(m) not in lora_factors and m.weight.dtype in LOW_BITS
            and path.rsplit(".", 1)[-1] not in skip]


def keep_16bit_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Make every nn.Linear with a 16-bit weight but the LoRA factors an UpcastLinear (the same Parameters, not
    copied): stored as read, computed in fp32, frozen (an UpcastLinear computes no weight gradient, so its weight
    and bias stop requiring one); in place. Linears whose name is in `skip` (the output head) are left alone.
    Returns their paths."""
    found = low_bit_linears(model, skip)
    for _, m in found:
        m.requires_grad_(False)
    swap_modules(model, [(path, linear_as(UpcastLinear, m, m.weight, m.bias)) for path, m in found])
    return [path for path, _ in found]


def keep_16bit_embeddings(model: nn.Module) -> list[str]:
    """Make every nn.Embedding with a 16-bit table a ``CastEmbedding`` returning fp32 rows (the same Parameter,
    not copied: a tied head keeps sharing it), frozen; in place. Returns their paths."""
    found = [(path, m) for path, m in model.named_modules() if type(m) is nn.Embedding and m.weight.dtype in LOW_BITS]
    for _, m in found:
        m.requires_grad_(False)
    swap_modules(model, [(path, embedding_as(m, m.weight, torch.float32)) for path, m in found])
    return [path for path, _ in found]


def workspace_numel(model: nn.Module, exclude: tuple[str, ...] = OUTPUT_HEADS) -> int:
    """Values of the largest weight a product casts or dequantizes into the shared workspace (0 if none), the
    modules named in `exclude` aside: the workspace's size in the blocks."""
    return max((m.in_features * m.out_features for path, m in model.named_modules()
                if isinstance(m, (UpcastLinear, QuantizedLinear)) and path.rsplit(".", 1)[-1] not in exclude),
               default=0)


# output rows a head casts and multiplies at a time, at most. Measured on an AMD EPYC (Zen 3, 32 MiB L3, 2 cores;
# medians of 5 interleaved rounds), the forward and input gradient of a bf16 head for 512 tokens, against the same
# head stored in fp32: at 128,256 x 2,048 3.97 s in chunks of 2,048 rows, 4.30 s in chunks of 8,192, 3.92 s in
# fp32; at 32,000 x 4,096 1.71 s, 1.78 s and 1.68 s. On one thread (a second measurement, 32,000 x 2,048, 4 rounds)
# 1.78 s in chunks of 2,048, 1.80 s in chunks of 8,192, 1.73 s cast whole, 1.69 s in fp32. A chunk that stays in
# the last-level cache is multiplied before it is evicted
HEAD_CHUNK_ROWS = 2048


def chunk_heads(model: nn.Module, heads: tuple[str, ...] = OUTPUT_HEADS) -> dict[str, int]:
    """Give each UpcastLinear head a ``rows_per_product``: at most HEAD_CHUNK_ROWS rows, and no more values than
    the largest block weight (at least one row), so the head's products reuse the blocks' workspace as it is.
    Returns path -> rows for the heads chunked (those with more rows than that)."""
    budget = workspace_numel(model, heads)
    chunked = {}
    for path, m in model.named_modules():
        if type(m) is UpcastLinear and path.rsplit(".", 1)[-1] in heads and budget:
            rows = max(1, min(HEAD_CHUNK_ROWS, budget // m.in_features))
            if m.out_features > rows:
                m.rows_per_product = chunked[path] = rows
    return chunked


def compute_in_fp32(model: nn.Module, head_16bit: bool = True) -> nn.Module:
    """fp32 compute for a model read in any float dtype, without upcasting a 16-bit one: its frozen Linears become
    UpcastLinear (``keep_16bit_linears``; the head in chunks, ``chunk_heads``), its token embeddings 16-bit tables
    with fp32 rows out (``keep_16bit_embeddings``), every other float tensor but the LoRA factors becomes fp32, and
    the fp32 Linears take ``use_fp32_products``; in place. head_16bit False: the head becomes fp32 once (for
    generation, where a token at a time would cast the whole head per token; a tied embedding follows it). A no-op
    on an fp32 model but for that last step. Returns the model."""
    keep_16bit_linears(model, () if head_16bit else OUTPUT_HEADS)
    chunk_heads(model)
    keep_16bit_embeddings(model)
    cast_float_tensors(model, torch.float32, keep=(UpcastLinear, CastEmbedding))
    return use_fp32_products(model)


def compute_in_fp32_for_generation(model: nn.Module, available_bytes: int) -> bool:
    """fp32 compute for generating from a model read in any float dtype (``generate --precision fp32``), in place:
    the head becomes fp32 once, and so do the 16-bit block Linears where their fp32 copy (2 bytes a value more)
    takes at most half of `available_bytes`; otherwise each product casts its weight (``compute_in_fp32``). A token
    at a time reads every weight once, so casting it per product is much of a token's work (benchmarks/RESULTS.md,
    "Generation: a bf16 checkpoint in fp32 or as stored"). The tokens are the same either way (a 16-bit value is
    exact in fp32). Returns whether the block Linears were upcast."""
    linears = low_bit_linears(model, OUTPUT_HEADS)
    extra = sum(2 * sum(p.numel() for p in m.parameters(recurse=False)) for _, m in linears)
    once = extra <= available_bytes // 2
    if once:
        for _, m in linears:
            m.float()  # one Linear at a time: the 16-bit weight is freed as its fp32 copy takes its place
    compute_in_fp32(model, head_16bit=False)
    return once

"""fp32 compute on a 16-bit checkpoint (bf16 or fp16, as Llama 3, Qwen2.5 and Mistral ship) without upcasting it whole.

    model = load_base(folder)[0]      # a bf16 checkpoint, read as it is stored
    compute_in_fp32(model)            # what build_for_training does for LoRA and QLoRA in fp32 on CPU

CPUs without bf16 units run bf16 products many times slower than fp32 ones, and an fp32 copy of a 7B model is
28 GB. So each frozen block Linear stays as read, as an ``UpcastLinear``: every product casts its weight to fp32
into a workspace shared by every layer (miniquant's, where NF4 dequantizes) and multiplies there, in forward and
again in backward for the input's gradient. Nothing fp32 of the weight outlives the product.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from miniquant.quantize import DequantLinearFunction, workspace_buffer

from .lora import OUTPUT_HEADS
from .precision import LOW_BITS, _factor_modules, _linear_as, _swap, use_fp32_products
from .qlora import cast_float_tensors


class UpcastLinear(nn.Linear):
    """A frozen Linear stored in 16 bits (a bf16 or fp16 checkpoint's weight, as read) that computes in fp32.

    Each product casts the weight into a workspace shared by every layer (miniquant's, where NF4 dequantizes)
    and multiplies there, in forward and again in backward (``DequantLinearFunction``: the input's gradient
    only, nothing fp32 kept): the model keeps 16-bit memory and runs fp32 products, which CPUs without bf16
    units run many times faster than bf16 ones. An input in another dtype computes in the weight's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)  # (..., out)
        x2 = x.reshape(-1, self.in_features)  # (N, in): the Function's output is then a plain (N, out) tensor
        y = DequantLinearFunction.apply(x2, self.bias, self, self.weight)  # the weight saved: no copy
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)  # (..., out)

    def dequantize_from(self, tensors: tuple[torch.Tensor, ...], dtype: torch.dtype, transient: bool = False
                        ) -> torch.Tensor:
        """The (out, in) weight in `dtype`: in the shared workspace when `transient` (valid until its next use)."""
        w = tensors[0]
        out = workspace_buffer(w.numel(), dtype, w.device).view(w.shape) if transient else torch.empty_like(w, dtype=dtype)
        return out.copy_(w)


def keep_16bit_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Make every nn.Linear with a 16-bit weight but the LoRA factors an UpcastLinear (the same Parameters, not
    copied): stored as read, computed in fp32, frozen (an UpcastLinear computes no weight gradient, so its weight
    and bias stop requiring one); in place. Linears whose name is in `skip` (the output head) are left alone.
    Returns their paths."""
    lora_factors = _factor_modules(model)
    found = [(path, m) for path, m in model.named_modules()
             if type(m) is nn.Linear and id(m) not in lora_factors and m.weight.dtype in LOW_BITS
             and path.rsplit(".", 1)[-1] not in skip]
    for _, m in found:
        m.requires_grad_(False)
    _swap(model, [(path, _linear_as(UpcastLinear, m, m.weight, m.bias)) for path, m in found])
    return [path for path, _ in found]


def compute_in_fp32(model: nn.Module, skip: tuple[str, ...] = OUTPUT_HEADS) -> nn.Module:
    """fp32 compute for a model read in any float dtype, without upcasting a 16-bit one whole: its frozen block
    Linears become UpcastLinear (``keep_16bit_linears``), every other float tensor but the LoRA factors becomes
    fp32, and the fp32 Linears take ``use_fp32_products``; in place. A no-op on an fp32 model but for that last
    step. Returns the model."""
    keep_16bit_linears(model, skip)
    cast_float_tensors(model, torch.float32, keep=(UpcastLinear,))
    return use_fp32_products(model)

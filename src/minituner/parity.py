"""Parity with the real tools, as numbers: PEFT loading our adapter folder, bitsandbytes quantizing our NF4 targets.

Each check returns the max |logit difference| against our model, or None when the tool is not installed.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from .lora import lora_modules
from .precision import use_fp32_products


@torch.no_grad()
def peft_max_logit_diff(fresh_base: nn.Module, peft_folder: Path, ours: nn.Module, x: torch.Tensor) -> float | None:
    """PeftModel.from_pretrained(fresh_base, peft_folder) against `ours` on token ids `x` (B, T)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    theirs = PeftModel.from_pretrained(fresh_base, peft_folder).eval()
    return float((theirs(x) - ours(x)).abs().max())


@torch.no_grad()
def bnb_nf4_max_logit_diff(lora_model: nn.Module, x: torch.Tensor, ours: torch.Tensor,
                           blocksize: int = 64) -> float | None:
    """Quantize and dequantize every LoRA-wrapped float base weight with bitsandbytes' NF4, then compare the
    logits on `x` with `ours` (our NF4 model's logits). The weights of `lora_model` are changed in place."""
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return None
    for m in lora_modules(lora_model).values():
        w = m.base_layer.weight
        packed, state = bnb.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
        w.copy_(bnb.dequantize_4bit(packed, state))  # MiniGPT's rows are whole blocks: its native kernel is right
    use_fp32_products(lora_model)  # the products through the same library as our QLoRA model's (fp32_gemm)
    return float((lora_model(x) - ours).abs().max())

"""The figures Lab 01 explains, from a shape alone: per-block arithmetic by hand, NF4 overheads, scale rows.

Each function returns plain numbers (the lab formats them); nothing here builds a model.
"""
from __future__ import annotations

from fractions import Fraction

from minigpt.errors import InputError

from .counts import block_linear_weights, lora_params, lora_trainable_params
from .memory import NF4_BLOCK, MemoryConfig, Regime, default_regimes, nf4_bytes, plan, quantized_params, regime_bytes
from .presets import preset_shape
from .shapes import ATTENTION, ModelShape


def hand_check(shape: ModelShape, r: int = 8) -> dict[str, int]:
    """The seed's per-block arithmetic from d and d_ff, checked against the planner (a mismatch raises)."""
    d, ff = shape.d_model, shape.d_ff
    by_hand = {"weights": 4 * d * d + d * ff + ff * d, "lora": 4 * r * (d + d) + r * (d + ff) + r * (ff + d),
               "attn_w": 4 * d * d, "attn_lora": 4 * r * (d + d)}
    attn = [lin for lin in shape.linears if lin.kind == ATTENTION]
    planner = {"weights": block_linear_weights(shape), "lora": lora_trainable_params(shape, r) // shape.n_layer,
               "attn_w": sum(x.weight_params for x in attn), "attn_lora": sum(lora_params(x, r) for x in attn)}
    if by_hand != planner:
        raise InputError(f"hand check failed: {by_hand} != {planner}")
    return by_hand


def attention_lora_ratio(shape: ModelShape, r: int = 8) -> Fraction:
    """LoRA parameters over weights of the attention projections (2r/h for square h x h layers)."""
    attn = [lin for lin in shape.linears if lin.kind == ATTENTION]
    return Fraction(sum(lora_params(x, r) for x in attn), sum(x.weight_params for x in attn))


def nf4_overheads(shape: ModelShape, r: int = 8) -> dict[str, int]:
    """Bytes of the quantized weights under each reading of the seed: fp32 absmax, fp16 scale, double quant."""
    q = quantized_params(shape)
    return {"quantized": q,
            "fp32_absmax": shape.n_layer * sum(nf4_bytes(lin.weight_params) for lin in shape.linears),
            "fp16_scale": q // 2 + 2 * (q // NF4_BLOCK),
            "double_quant": shape.n_layer * sum(nf4_bytes(lin.weight_params, True) for lin in shape.linears),
            "qlora_weights": regime_bytes(shape, Regime("qlora", r)).weights}


def master_copy_split(shape: ModelShape) -> dict[str, dict[str, int]]:
    """Full FT (mixed precision) buckets under the seed's convention and ZeRO's: same total, 4N moved."""
    return {where: regime_bytes(shape, Regime("full"), cfg=MemoryConfig(master_copy=where)).to_dict()
            for where in ("weights", "optimizer")}


def scale_plans(names: tuple[str, ...], vocab: int, r: int = 8) -> dict:
    """Full FT, LoRA r and QLoRA r for each preset, the same assumptions for every row."""
    return {name: plan(preset_shape(name, vocab), default_regimes([r])) for name in names}

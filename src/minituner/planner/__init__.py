"""The planner: parameter counts and memory of full fine-tuning, LoRA and QLoRA, by arithmetic alone.

    shape = preset_shape("llama-7b")                       # or minigpt_shape(GPTConfig(...)),
    lora_trainable_params(shape, 8, "q_proj,v_proj")       #    load_config_shape("config.json")
    plan(shape, default_regimes([8]), "all-linear").to_dict()
"""
from .counts import (ALL_LINEAR, KINDS, adapter_bytes, block_linear_weights, lora_params, lora_trainable_params,
                     param_counts, parse_targets, resolve_targets, total_params, valid_targets)
from .hf import FAMILIES, config_context, load_config_shape, shape_from_config
from .memory import (Buckets, MemoryConfig, Plan, Regime, RegimePlan, default_regimes, korthikanti_activation_bytes,
                     nf4_bytes, nf4_weight_bytes, plan, quantized_params, regime_bytes, seed_activation_bytes)
from .presets import PRESETS, builtin_vocab_size, minigpt_vocab, preset_context, preset_shape, simplified_shape
from .shapes import LinearShape, ModelShape, NormShape, minigpt_shape

__all__ = [
    "ALL_LINEAR", "KINDS", "FAMILIES", "PRESETS", "Buckets", "LinearShape", "MemoryConfig", "ModelShape", "NormShape",
    "Plan", "Regime", "RegimePlan", "adapter_bytes", "block_linear_weights", "builtin_vocab_size", "config_context",
    "default_regimes", "korthikanti_activation_bytes", "load_config_shape", "lora_params", "lora_trainable_params",
    "minigpt_shape", "minigpt_vocab", "nf4_bytes", "nf4_weight_bytes", "param_counts", "parse_targets", "plan",
    "preset_context", "preset_shape", "quantized_params", "regime_bytes", "resolve_targets", "seed_activation_bytes",
    "shape_from_config", "simplified_shape", "total_params", "valid_targets",
]

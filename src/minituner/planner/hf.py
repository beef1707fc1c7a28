"""Shapes of Hugging Face ``config.json`` files of the gpt2, llama, mistral and qwen2 families.

Each reader mirrors the family's modeling code in transformers, including the defaults its config
class fills in for a missing key, so the count equals ``sum(p.numel())`` of the instantiated model:
GPT-2's fused ``c_attn`` (a Conv1D of h -> 3h) and biased Conv1Ds/LayerNorms with learned positions;
LLaMA/Mistral/Qwen2's GQA (k/v width = num_key_value_heads * head_dim), SwiGLU MLPs
(gate/up/down), RMSNorms without bias, rotary positions without parameters; LLaMA's optional
``attention_bias``/``mlp_bias``; Qwen2's biased q/k/v (not o); tied or untied embeddings.
The rotary families are read once, into the DecoderConfig the model is built from
(``minituner.hf_config.decoder_config_from_hf``); their shape is derived from it.
"""
from __future__ import annotations

from pathlib import Path

from minigpt.base_folder import CONFIG
from minigpt.decoder import DecoderConfig
from minigpt.errors import InputError
from minigpt.io import read_json
from minigpt.model import GPTConfig

from ..hf_config import config_bool, config_int, decoder_config_from_hf
from .shapes import ATTENTION, MLP, LinearShape, ModelShape, NormShape, minigpt_shape

FAMILIES = ("gpt2", "llama", "minigpt", "mistral", "qwen2")


def _gpt2(cfg: dict, where: str) -> ModelShape:
    # GPT2Config defaults; attribute_map lets a config say hidden_size for n_embd, etc.
    h = config_int(cfg, "n_embd", 768, where, ("hidden_size",))
    n_layer = config_int(cfg, "n_layer", 12, where, ("num_hidden_layers",))
    n_head = config_int(cfg, "n_head", 12, where, ("num_attention_heads",))
    if h % n_head:
        raise InputError(f"{where}: n_head={n_head} does not divide n_embd={h}")
    if config_bool(cfg, "add_cross_attention", False, where):
        raise InputError(f"{where}: add_cross_attention is not supported (decoder-only GPT-2 only)")
    ff = cfg.get("n_inner")
    ff = 4 * h if ff is None else config_int(cfg, "n_inner", None, where)
    linears = (
        LinearShape("attn.c_attn", ATTENTION, h, 3 * h, True),  # fused q, k, v
        LinearShape("attn.c_proj", ATTENTION, h, h, True),
        LinearShape("mlp.c_fc", MLP, h, ff, True),
        LinearShape("mlp.c_proj", MLP, ff, h, True),
    )
    return ModelShape(
        family="gpt2", name=where, vocab_size=config_int(cfg, "vocab_size", 50257, where), d_model=h,
        n_layer=n_layer, n_head=n_head, n_kv_head=n_head, head_dim=h // n_head, d_ff=ff,
        n_positions=config_int(cfg, "n_positions", 1024, where, ("max_position_embeddings",)),
        tie_embeddings=config_bool(cfg, "tie_word_embeddings", True, where), linears=linears,
        norms=(NormShape("ln_1", h, True), NormShape("ln_2", h, True)), final_norm=NormShape("ln_f", h, True),
    )


def _rotary(cfg: dict, where: str) -> ModelShape:
    """The shape of the DecoderConfig that hf_config reads (one reader for model and planner)."""
    return decoder_shape(decoder_config_from_hf(cfg, where, check_rope=False), where)  # scaling: frequencies only


def decoder_shape(d: DecoderConfig, name: str = "decoder") -> ModelShape:
    """The shape of ``minigpt.decoder.Decoder(d)`` for the llama family's layout (RMSNorm, rotary, SwiGLU)."""
    if (d.norm, d.positions, d.mlp) != ("rmsnorm", "rope", "swiglu"):
        raise InputError(f"{name}: the planner covers decoders with RMSNorm, rotary positions and a SwiGLU MLP "
                         f"(the llama family), not norm={d.norm!r}, positions={d.positions!r}, mlp={d.mlp!r}")
    h, ff, q_out, kv_out = d.d_model, d.d_ff, d.n_head * d.head_dim, d.n_kv_head * d.head_dim
    linears = (
        LinearShape("self_attn.q_proj", ATTENTION, h, q_out, d.qkv_bias),
        LinearShape("self_attn.k_proj", ATTENTION, h, kv_out, d.qkv_bias),
        LinearShape("self_attn.v_proj", ATTENTION, h, kv_out, d.qkv_bias),
        LinearShape("self_attn.o_proj", ATTENTION, q_out, h, d.o_bias),
        LinearShape("mlp.gate_proj", MLP, h, ff, d.mlp_bias),
        LinearShape("mlp.up_proj", MLP, h, ff, d.mlp_bias),
        LinearShape("mlp.down_proj", MLP, ff, h, d.mlp_bias),
    )
    window = d.sliding_window if d.sliding_layers else None
    return ModelShape(
        family=d.model_type, name=name, vocab_size=d.vocab_size, d_model=h, n_layer=d.n_layer, n_head=d.n_head,
        n_kv_head=d.n_kv_head, head_dim=d.head_dim, d_ff=ff, n_positions=0, tie_embeddings=d.tie_word_embeddings,
        linears=linears, norms=(NormShape("input_layernorm", h, False), NormShape("post_attention_layernorm", h, False)),
        final_norm=NormShape("norm", h, False), sliding_window=window,
        sliding_layers=tuple(d.sliding_layers) if window is not None else (),
    )


def shape_from_config(cfg: dict, name: str = "config") -> ModelShape:
    """A ModelShape from a config dict: a Hugging Face config.json or a MiniGPT base's config.json."""
    if not isinstance(cfg, dict):
        raise InputError(f"{name}: expected a JSON object")
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise InputError(f"{name}: model_type {family!r} is not supported; valid: {', '.join(FAMILIES)}")
    if family == "gpt2":
        return _gpt2(cfg, name)
    if family == "minigpt":
        fields = {k: v for k, v in cfg.items() if k != "model_type"}
        try:
            return minigpt_shape(GPTConfig.from_dict(fields), name)
        except TypeError as e:
            raise InputError(f"{name}: {e}") from None
        except InputError as e:
            raise InputError(f"{name}: {e}") from None
    return _rotary(cfg, name)


def load_config_shape(path: str | Path) -> ModelShape:
    """Read config.json (or a folder holding one) into a ModelShape; a missing or bad file is an InputError."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG
    return shape_from_config(read_json(path), str(path))


def config_context(path: str | Path) -> int:
    """The longest sequence the model of a config.json (or its folder) takes, read as the planner reads it:
    its learned positions (GPT-2's n_positions, MiniGPT's block_size), else max_position_embeddings."""
    path = Path(path)
    path = path / CONFIG if path.is_dir() else path
    cfg = read_json(path)
    shape = shape_from_config(cfg, str(path))
    return shape.n_positions or decoder_config_from_hf(cfg, str(path), check_rope=False).block_size

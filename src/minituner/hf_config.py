"""Hugging Face ``config.json`` -> the config our models and the planner use: one reader per format.

* gpt2 -> ``GPTConfig`` (MiniGPT computes GPT-2): ``minituner.hf_gpt2.config_from_gpt2``, re-exported here.
* llama, mistral, qwen2 -> ``DecoderConfig`` (``minigpt.decoder``): ``decoder_config_from_hf`` below.

``decoder_config_from_hf`` mirrors transformers' config classes and modeling code, including the default a
config class fills in for a missing key, so the model built from it has transformers' parameters and
logits, and the planner's counts (``planner/hf.py`` derives its shapes from it) equal
``sum(p.numel())`` of the transformers model:
* head_dim: the config's when given, else hidden_size // num_attention_heads;
* rotary positions: ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling`` (older
  files); scaling types "default" and "llama3" are computed, any other is refused by name;
* biases: llama's ``attention_bias`` (q, k, v and o) and ``mlp_bias``; qwen2's q, k, v (not o); none in mistral;
* sliding window: mistral applies ``sliding_window`` to every layer when it is set; qwen2 only with
  ``use_sliding_window`` true, on layers i >= ``max_window_layers`` (or as its saved ``layer_types`` say).
"""
from __future__ import annotations

from pathlib import Path

from minigpt.base_folder import CONFIG
from minigpt.decoder import ACTIVATIONS, DecoderConfig
from minigpt.errors import InputError
from minigpt.io import read_json

from .hf_gpt2 import config_from_gpt2  # noqa: F401  (the gpt2 reader; re-exported)

ROTARY_FAMILIES = ("llama", "mistral", "qwen2")
FAMILIES = ("gpt2",) + ROTARY_FAMILIES
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
SUPPORTED_ROPE = ("default", "llama3")

# Config-class defaults of transformers' LlamaConfig, MistralConfig and Qwen2Config.
DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "sliding_window": 4096, "max_window_layers": 28},
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default_theta for all three families


def config_int(cfg: dict, key: str, default, where: str, aliases: tuple[str, ...] = ()) -> int:
    """A positive integer from cfg[key] (or the first alias present), else the family's default."""
    value = cfg.get(key)
    for alias in aliases:
        if value is None:
            value = cfg.get(alias)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def config_bool(cfg: dict, key: str, default: bool, where: str) -> bool:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise InputError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _float(d: dict, key: str, default: float, where: str) -> float:
    value = d.get(key)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InputError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def rope_fields(cfg: dict, where: str, max_pos: int, check: bool = True) -> dict:
    """RoPE settings as DecoderConfig fields, from rope_parameters / rope_scaling / rope_theta.

    With check=False (shape counting) an unsupported scaling type is read as "default" rather than refused:
    it changes frequencies, never shapes.
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise InputError(f"{where}: rope_scaling must be an object or null, got {params!r}")
    theta = _float(params, "rope_theta", _float(cfg, "rope_theta", DEFAULT_ROPE_THETA, where), where)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        if check:
            raise InputError(f"{where}: rope_scaling type {rope_type!r} is not supported; valid: {', '.join(SUPPORTED_ROPE)}")
        rope_type = "default"
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if check and partial not in (None, 1, 1.0):
        raise InputError(f"{where}: partial_rotary_factor={partial!r} is not supported (1.0 only)")
    out = {"rope_theta": theta, "rope_type": rope_type}
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise InputError(f"{where}: rope_scaling of type 'llama3' is missing {missing}")
        out.update(rope_factor=_float(params, "factor", 0, where),
                   rope_low_freq_factor=_float(params, "low_freq_factor", 0, where),
                   rope_high_freq_factor=_float(params, "high_freq_factor", 0, where),
                   rope_original_max_position_embeddings=config_int(params, "original_max_position_embeddings", max_pos, where))
        if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
            raise InputError(f"{where}: rope_scaling high_freq_factor must exceed low_freq_factor")
    return out


def _sliding(cfg: dict, family: str, n_layer: int, where: str) -> tuple[int | None, list[int]]:
    """(window, the layers that use it) as transformers' MistralModel / Qwen2Model compute them."""
    dflt = DEFAULTS[family]
    if family == "llama":
        return None, []
    window = cfg.get("sliding_window", dflt["sliding_window"])
    if family == "qwen2" and not config_bool(cfg, "use_sliding_window", False, where):
        window = None  # Qwen2Config drops the window unless use_sliding_window is true
    if window is None:
        return None, []
    window = config_int({"sliding_window": window}, "sliding_window", None, where)
    if family == "mistral":
        return window, list(range(n_layer))
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layer:
            raise InputError(f"{where}: layer_types must list one type per layer ({n_layer})")
        return window, [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    first = config_int(cfg, "max_window_layers", dflt["max_window_layers"], where)
    return window, [i for i in range(n_layer) if i >= first]


def decoder_config_from_hf(cfg: dict, where: str = "config.json", check_rope: bool = True) -> DecoderConfig:
    """A llama / mistral / qwen2 config.json (as a dict) -> the DecoderConfig computing transformers' model.

    check_rope=False is for shape counting only (see rope_fields).
    """
    if not isinstance(cfg, dict):
        raise InputError(f"{where}: expected a JSON object")
    family = cfg.get("model_type")
    if family not in ROTARY_FAMILIES:
        raise InputError(f"{where}: model_type {family!r} is not supported; valid: {', '.join(FAMILIES)}")
    dflt = DEFAULTS[family]
    h = config_int(cfg, "hidden_size", dflt["hidden_size"], where)
    n_head = config_int(cfg, "num_attention_heads", dflt["num_attention_heads"], where)
    # absent: the family's default; null: one K/V head per query head, as the configs' __init__ read None
    kv_default = n_head if "num_key_value_heads" in cfg else dflt["num_key_value_heads"] or n_head
    n_kv = config_int(cfg, "num_key_value_heads", kv_default, where)
    if n_head % n_kv:
        raise InputError(f"{where}: num_key_value_heads={n_kv} does not divide num_attention_heads={n_head}")
    head_dim = config_int(cfg, "head_dim", h // n_head or None, where)  # the config's, else hidden // heads
    if family == "llama" and h % n_head:  # LlamaConfig.validate_architecture
        raise InputError(f"{where}: num_attention_heads={n_head} does not divide hidden_size={h}")
    if family == "llama":
        qkv_bias = o_bias = config_bool(cfg, "attention_bias", False, where)
        mlp_bias = config_bool(cfg, "mlp_bias", False, where)
    elif family == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = mlp_bias = False
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise InputError(f"{where}: hidden_act {act!r} is not supported; valid: {sorted(ACTIVATIONS)}")
    n_layer = config_int(cfg, "num_hidden_layers", dflt["num_hidden_layers"], where)
    max_pos = config_int(cfg, "max_position_embeddings", dflt["max_position_embeddings"], where)
    window, sliding_layers = _sliding(cfg, family, n_layer, where)
    fields = dict(  # each reader names `where` in its own errors
        model_type=family, vocab_size=config_int(cfg, "vocab_size", dflt["vocab_size"], where), block_size=max_pos,
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv, d_model=h, head_dim=head_dim,
        d_ff=config_int(cfg, "intermediate_size", dflt["intermediate_size"], where),
        norm="rmsnorm", norm_eps=_float(cfg, "rms_norm_eps", dflt["rms_norm_eps"], where), positions="rope",
        **rope_fields(cfg, where, max_pos, check_rope), mlp="swiglu", activation=act,
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        tie_word_embeddings=config_bool(cfg, "tie_word_embeddings", False, where),
        sliding_window=window, sliding_layers=sliding_layers,
        attention_dropout=_float(cfg, "attention_dropout", 0.0, where),
    )
    try:
        return DecoderConfig(**fields)
    except InputError as e:  # DecoderConfig's own checks (e.g. heads that do not divide) name no file
        raise InputError(f"{where}: {e}") from None


def read_decoder_config(folder: str | Path) -> DecoderConfig:
    """config.json of a llama / mistral / qwen2 folder -> DecoderConfig."""
    path = Path(folder) / CONFIG
    return decoder_config_from_hf(read_json(path), str(path))


def eos_token_ids(folder: str | Path) -> list[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id when it has one, else config.json's."""
    folder = Path(folder)
    for name in ("generation_config.json", CONFIG):
        path = folder / name
        if not path.is_file():
            continue
        eos = read_json(path).get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InputError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
        return ids
    return []

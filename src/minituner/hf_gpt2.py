"""Hugging Face GPT-2 checkpoints <-> MiniGPT, from a local folder (config.json + model.safetensors).

No hub access and no ``transformers`` import: the folder is read with ``minigpt.io`` and the tensors
are renamed and reshaped by pure functions over state dicts.

GPT-2 is MiniGPT's architecture already (pre-LayerNorm, learned positions, biases everywhere, GELU,
tied ``lm_head``), so the import is a renaming, with one real choice:

* **The fused ``attn.c_attn`` is split into ``q_proj``, ``k_proj``, ``v_proj``.** The imported model is
  a plain MiniGPT, so its module names, the LoRA targets (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
  ``fc1``, ``fc2``) and the planner's arithmetic apply unchanged. Consequence for LoRA: an adapter of
  rank r on q and on v trains r·(d + d) parameters each (2·r·2d for the pair), whereas PEFT's LoRA on
  GPT-2's fused ``c_attn`` trains one A (r × d) and one B (3d × r), r·(d + 3d), and updates q, k and v
  together. The two are different adapters: ours cannot be loaded into PEFT's ``c_attn`` target or
  vice versa (``k_proj`` left untargeted corresponds to rows of B held at zero, which PEFT does not do).
* GPT-2's ``Conv1D`` stores its weight as (in, out) and computes x @ W + b; ``nn.Linear`` stores
  (out, in), so every projection is transposed. ``c_proj`` -> ``o_proj``, ``mlp.c_fc`` -> ``fc1``,
  ``mlp.c_proj`` -> ``fc2``.
* Keys with or without the ``transformer.`` prefix are accepted; the causal-mask buffers
  ``attn.bias`` / ``attn.masked_bias`` that older versions saved are ignored; ``lm_head.weight`` may be
  absent when tied (when present it must equal ``wte.weight``); an untied head is loaded as MiniGPT's
  ``tie_weights=False``.
* Weights are loaded as float32 whatever their stored dtype.
* MiniGPT has one dropout rate where GPT-2 has three (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``,
  used in the same places); we take ``resid_pdrop``. It changes training noise only, never eval logits.
* Refused with an InputError naming the option: ``scale_attn_by_inverse_layer_idx``,
  ``reorder_and_upcast_attn``, ``add_cross_attention``, ``scale_attn_weights=false`` and any activation
  other than GELU (exact ``gelu``; ``gelu_new`` / ``gelu_pytorch_tanh`` / ``gelu_fast`` -> ``gelu_tanh``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from minigpt.base_folder import CONFIG, WEIGHTS, WEIGHTS_INDEX
from minigpt.errors import InputError
from minigpt.io import atomic_save_safetensors, load_safetensors, read_json, write_json
from minigpt.model import GPTConfig, MiniGPT

REQUIRED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# option -> the value MiniGPT computes; any other value is refused.
FIXED_OPTIONS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}
IGNORED_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not weights


def config_from_gpt2(d: dict, where: str = CONFIG) -> GPTConfig:
    """A GPT-2 config.json (as a dict) -> the GPTConfig that computes the same function."""
    if d.get("model_type") != "gpt2":
        raise InputError(f"{where}: model_type is {d.get('model_type')!r}, expected 'gpt2'")
    missing = [k for k in REQUIRED if d.get(k) is None]
    if missing:
        raise InputError(f"{where}: missing GPT-2 config fields {missing}")
    for option, supported in FIXED_OPTIONS.items():
        if d.get(option, supported) != supported:
            raise InputError(f"{where}: {option}={d[option]!r} is not supported (MiniGPT has {option}={supported})")
    act = d.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise InputError(f"{where}: activation_function {act!r} is not supported; valid: {sorted(ACTIVATIONS)}")
    n_inner = d.get("n_inner")
    tie = d.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):  # bool("false") is True
        raise InputError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    try:
        return GPTConfig(
            vocab_size=d["vocab_size"],
            block_size=d["n_positions"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            d_model=d["n_embd"],
            d_ff=4 * d["n_embd"] if n_inner is None else n_inner,
            dropout=float(d.get("resid_pdrop", 0.1)),
            bias=True,
            tie_weights=tie,
            activation=ACTIVATIONS[act],
            layer_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        )
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise InputError(f"{where}: bad GPT-2 config value ({e})") from None


def gpt2_config_dict(cfg: GPTConfig) -> dict:
    """The inverse of config_from_gpt2: a config.json that transformers reads as GPT2LMHeadModel."""
    if not cfg.bias:
        raise InputError("GPT-2 has biases in every Linear and LayerNorm; this MiniGPT has bias=False")
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "tie_word_embeddings": cfg.tie_weights,
        **FIXED_OPTIONS,
    }


def _strip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``transformer.`` prefix and the causal-mask buffers."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("transformer.")
        if not k.endswith(IGNORED_BUFFERS):  # "h.0.attn.c_attn.bias" is kept: "_attn.bias"
            out[k] = v
    return out


def minigpt_state_dict_from_gpt2(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors -> MiniGPT state dict (float32, lm_head included, tied or not); InputError on misfit."""
    src = _strip(sd)
    d, used, out = cfg.d_model, set(), {}

    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in src:
            raise InputError(f"GPT-2 weights are missing {key!r}")
        t = src[key]
        if tuple(t.shape) != shape:
            raise InputError(f"GPT-2 weight {key!r} has shape {tuple(t.shape)}, config implies {shape}")
        if not t.is_floating_point():
            raise InputError(f"GPT-2 weight {key!r} is {str(t.dtype).removeprefix('torch.')}; a model's weights are "
                             "floating point")
        used.add(key)
        return t.to(torch.float32)

    out["wte.weight"] = take("wte.weight", (cfg.vocab_size, d))
    out["wpe.weight"] = take("wpe.weight", (cfg.block_size, d))
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{b}{ln}.weight"] = take(f"{h}{ln}.weight", (d,))
            out[f"{b}{ln}.bias"] = take(f"{h}{ln}.bias", (d,))
        qkv_w = take(f"{h}attn.c_attn.weight", (d, 3 * d))  # Conv1D (in, 3*out)
        qkv_b = take(f"{h}attn.c_attn.bias", (3 * d,))
        for name, w, bias in zip(("q_proj", "k_proj", "v_proj"), qkv_w.split(d, dim=1), qkv_b.split(d)):
            out[f"{b}attn.{name}.weight"] = w.t().contiguous()  # (out, in)
            out[f"{b}attn.{name}.bias"] = bias.contiguous()
        for theirs, ours, n_in, n_out in (
            ("attn.c_proj", "attn.o_proj", d, d),
            ("mlp.c_fc", "mlp.fc1", d, cfg.d_ff),
            ("mlp.c_proj", "mlp.fc2", cfg.d_ff, d),
        ):
            out[f"{b}{ours}.weight"] = take(f"{h}{theirs}.weight", (n_in, n_out)).t().contiguous()
            out[f"{b}{ours}.bias"] = take(f"{h}{theirs}.bias", (n_out,))
    out["ln_f.weight"] = take("ln_f.weight", (d,))
    out["ln_f.bias"] = take("ln_f.bias", (d,))
    head_key = "lm_head.weight"
    if cfg.tie_weights:
        if head_key in src:
            if not torch.equal(take(head_key, (cfg.vocab_size, d)), out["wte.weight"]):
                raise InputError("lm_head.weight differs from wte.weight but tie_word_embeddings is true")
        out[head_key] = out["wte.weight"]
    else:
        out[head_key] = take(head_key, (cfg.vocab_size, d))
    unexpected = sorted(set(src) - used)
    if unexpected:
        raise InputError(f"GPT-2 weights hold tensors MiniGPT has no place for: {unexpected[:5]}")
    return out


def gpt2_state_dict_from_minigpt(model: MiniGPT) -> dict[str, torch.Tensor]:
    """The inverse: MiniGPT -> GPT2LMHeadModel keys (``transformer.`` prefix, Conv1D layout)."""
    cfg, sd = model.config, model.state_dict()
    gpt2_config_dict(cfg)  # refuses what GPT-2 cannot hold
    out = {f"transformer.{k}": sd[k] for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{h}{ln}.weight"], out[f"{h}{ln}.bias"] = sd[f"{b}{ln}.weight"], sd[f"{b}{ln}.bias"]
        qkv = ("q_proj", "k_proj", "v_proj")
        out[f"{h}attn.c_attn.weight"] = torch.cat([sd[f"{b}attn.{n}.weight"].t() for n in qkv], dim=1)  # (in, 3*out)
        out[f"{h}attn.c_attn.bias"] = torch.cat([sd[f"{b}attn.{n}.bias"] for n in qkv])
        for theirs, ours in (("attn.c_proj", "attn.o_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            out[f"{h}{theirs}.weight"] = sd[f"{b}{ours}.weight"].t()
            out[f"{h}{theirs}.bias"] = sd[f"{b}{ours}.bias"]
    if not cfg.tie_weights:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def read_gpt2_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    if (folder / WEIGHTS).is_file():
        return load_safetensors(folder / WEIGHTS)
    if (folder / WEIGHTS_INDEX).is_file():
        weight_map = read_json(folder / WEIGHTS_INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{folder / WEIGHTS_INDEX}: no weight_map")
        sd: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            if not isinstance(name, str) or Path(name).name != name:
                raise InputError(f"{folder / WEIGHTS_INDEX}: shard name {name!r} is not a file in this folder")
            sd.update(load_safetensors(folder / name))
        return sd
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {others[:3]}: re-save with save_pretrained(..., safe_serialization=True))" if others else ""
    raise InputError(f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX}{hint}")


def load_gpt2(folder: str | Path, device: str | torch.device = "cpu") -> MiniGPT:
    """A Hugging Face GPT-2 folder -> MiniGPT in eval mode with the same logits."""
    folder = Path(folder)
    cfg = config_from_gpt2(read_json(folder / CONFIG), where=str(folder / CONFIG))
    try:
        sd = minigpt_state_dict_from_gpt2(read_gpt2_weights(folder), cfg)
    except InputError as e:
        raise InputError(f"{folder}: {e}") from None
    with torch.device("meta"):  # no random init of weights we are about to replace
        model = MiniGPT(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_weights:  # assign=True gave lm_head its own Parameter object; share wte's again
        model.lm_head.weight = model.wte.weight
    return model.to(device).eval()


def save_gpt2(model: MiniGPT, folder: str | Path) -> None:
    """Write a folder that ``GPT2LMHeadModel.from_pretrained`` loads (config.json + model.safetensors)."""
    folder = Path(folder)
    config = gpt2_config_dict(model.config)
    atomic_save_safetensors(gpt2_state_dict_from_minigpt(model), folder / WEIGHTS, metadata={"format": "pt"})
    write_json(folder / CONFIG, config)

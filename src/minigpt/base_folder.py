"""A base-model folder (MiniGPT): config.json + model.safetensors + tokenizer.json (+ manifest.json)."""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import InputError
from .io import atomic_save_safetensors, load_safetensors, read_json, write_json
from .model import GPTConfig, MiniGPT
from .tokenizer import CharTokenizer

CONFIG, WEIGHTS, TOKENIZER, MANIFEST = "config.json", "model.safetensors", "tokenizer.json", "manifest.json"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's index (Hugging Face folders)


def base_state_dict(model: MiniGPT) -> dict[str, torch.Tensor]:
    """The model's tensors, with a tied lm_head stored once (as wte.weight), as GPT-2 checkpoints do."""
    sd = model.state_dict()
    if model.config.tie_weights:
        sd.pop("lm_head.weight", None)
    return sd


def save_base(model: MiniGPT, tokenizer: CharTokenizer | None, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(base_state_dict(model), folder / WEIGHTS, metadata={"format": "pt"})
    write_json(folder / CONFIG, {"model_type": "minigpt", **model.config.to_dict()})
    if tokenizer is not None:
        tokenizer.save(folder / TOKENIZER)


def is_base_folder(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / CONFIG).is_file() and (folder / WEIGHTS).is_file()


def load_config(folder: str | Path) -> GPTConfig:
    d = read_json(Path(folder) / CONFIG)
    if d.pop("model_type", "minigpt") != "minigpt":
        raise InputError(f"{folder}/{CONFIG}: model_type is not minigpt")
    try:
        return GPTConfig.from_dict(d)
    except TypeError as e:
        raise InputError(f"{folder}/{CONFIG}: {e}") from None


def load_minigpt_folder(folder: str | Path, device: str | torch.device = "cpu") -> tuple[MiniGPT, CharTokenizer | None]:
    """Read a MiniGPT folder written by save_base; anything that is not such a folder is an InputError.

    Users load any base folder (MiniGPT or Hugging Face) with ``minituner.base_model.load_base``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such model folder")
    if not is_base_folder(folder):
        raise InputError(f"{folder}: not a model folder (needs {CONFIG} and {WEIGHTS})")
    cfg = load_config(folder)
    model = MiniGPT(cfg)
    sd = load_safetensors(folder / WEIGHTS)
    expected = base_state_dict(model)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    wrong = sorted(k for k in set(sd) & set(expected) if sd[k].shape != expected[k].shape)
    not_float = sorted(k for k in sd if not sd[k].is_floating_point())
    if not_float:
        raise InputError(f"{folder}/{WEIGHTS}: tensor {not_float[0]} holds {str(sd[not_float[0]].dtype)[6:]}, "
                         "not floating-point weights")
    if missing or unexpected or wrong:
        raise InputError(
            f"{folder}/{WEIGHTS} does not fit its {CONFIG}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    model.load_state_dict(sd, strict=False)
    tok_path = folder / TOKENIZER
    tokenizer = CharTokenizer.load(tok_path) if tok_path.is_file() else None
    if tokenizer is not None and tokenizer.vocab_size != cfg.vocab_size:
        raise InputError(f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but config says {cfg.vocab_size}")
    return model.to(device).eval(), tokenizer

"""Adapter files: minituner's own safetensors format, legacy ``.pt`` files, and loading any of them.

Format ``minituner-lora-v1``: one safetensors file whose keys are ``<module path>.lora_A.weight``
(r × in) and ``<module path>.lora_B.weight`` (out × r), e.g. ``blocks.0.attn.q_proj.lora_A.weight``
(PEFT's keys without the ``base_model.model.`` prefix), and whose metadata holds the LoRAConfig
(``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules`` as JSON).
A ``.pt`` / ``.pth`` / ``.bin`` adapter is read only with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.errors import InputError
from minigpt.io import atomic_save_safetensors, load_safetensors

from .lora import (LoRAConfig, adapter_config, apply_lora, linear_candidates, load_lora_state_dict, lora_state_dict,
                   mismatch_error)
from .zoo import delete_adapter

FORMAT = "minituner-lora-v1"
ADAPTER_FILE = "adapter_final.safetensors"
PICKLE_SUFFIXES = {".pt", ".pth", ".bin"}
PEFT_PREFIX = "base_model.model."


def save_adapter(model: nn.Module, path: str | Path, adapter_name: str | None = None) -> Path:
    """Write one adapter in minituner-lora-v1 (atomically); return the path."""
    path = Path(path)
    cfg = adapter_config(model, adapter_name)
    meta = {"format": FORMAT, "r": str(cfg.r), "lora_alpha": repr(float(cfg.alpha)),
            "lora_dropout": repr(float(cfg.dropout)), "use_rslora": json.dumps(cfg.use_rslora),
            "target_modules": json.dumps(cfg.target_modules)}
    atomic_save_safetensors(lora_state_dict(model, adapter_name), path, metadata=meta)
    return path


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise InputError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def config_from_metadata(meta: dict[str, str], path: Path) -> LoRAConfig | None:
    """The LoRAConfig stored by save_adapter, or None for a file without one."""
    if meta.get("format") != FORMAT:
        return None
    try:
        return LoRAConfig(r=int(meta["r"]), alpha=float(meta["lora_alpha"]), dropout=float(meta["lora_dropout"]),
                          use_rslora=bool(json.loads(meta["use_rslora"])),
                          target_modules=json.loads(meta["target_modules"]))
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(f"{path}: damaged {FORMAT} metadata ({e})") from None


def load_pickled_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A legacy .pt adapter, read with torch.load(weights_only=True): no code in the file runs."""
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a file it then refuses
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        raise InputError(f"{path}: refused or unreadable .pt file (weights_only load: {str(e).splitlines()[0]})") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise InputError(f"{path}: expected a dict of named tensors")
    return obj


def normalize_keys(sd: dict[str, torch.Tensor], adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Bring other spellings to '<path>.lora_A.weight': drop PEFT's prefix, an adapter name, or add '.weight'."""
    out = {}
    for k, v in sd.items():
        k = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        k = re.sub(rf"\.(lora_[AB])\.{re.escape(adapter_name)}\.weight$", r".\1.weight", k)
        k = re.sub(r"\.(lora_[AB])$", r".\1.weight", k)
        out[k] = v
    return out


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], LoRAConfig | None]:
    """Tensors (in our key format) and, when the file records one, the LoRAConfig of an adapter.

    `path` may be a minituner run folder, a PEFT folder, a .safetensors file or a legacy .pt file.
    """
    path = Path(path)
    if path.is_dir():
        from .peft_format import CONFIG_NAME, read_peft_adapter

        if (path / ADAPTER_FILE).is_file():
            path = path / ADAPTER_FILE
        elif (path / CONFIG_NAME).is_file():
            return read_peft_adapter(path)
        else:
            raise InputError(f"{path}: no {ADAPTER_FILE} or {CONFIG_NAME} in this folder")
    if not path.exists():
        raise InputError(f"{path}: adapter file not found")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return normalize_keys(load_pickled_tensors(path)), None
    sd = load_safetensors(path)
    return normalize_keys(sd), config_from_metadata(read_metadata(path), path)


def module_paths(sd: dict[str, torch.Tensor]) -> list[str]:
    """The module paths an adapter's keys name, in key order."""
    return list(dict.fromkeys(k.rsplit(".lora_", 1)[0] for k in sd if ".lora_" in k))


def load_adapter(model: nn.Module, path: str | Path, config: LoRAConfig | None = None,
                 adapter_name: str = "default") -> LoRAConfig:
    """Wrap `model` with the adapter stored at `path` and load its tensors (strict: names bad keys).

    Without `config` the file's own r/alpha are used and the targets are the modules its keys name;
    keys for modules this model lacks are reported as unexpected. `config` (needed for a .pt file,
    which records none) is used as given, so a different rank or target set is reported by key.
    """
    sd, file_cfg = read_adapter(path)
    if config is None:
        if file_cfg is None:
            raise InputError(f"{path}: the file records no LoRA config (r, alpha); pass one")
        candidates = linear_candidates(model)
        present = [p for p in module_paths(sd) if p in candidates]
        if not present:
            raise mismatch_error([], sorted(sd), [])
        config = replace(file_cfg, target_modules=present)
    apply_lora(model, config, adapter_name)
    try:
        load_lora_state_dict(model, sd, strict=True, adapter_name=adapter_name)
    except InputError:
        delete_adapter(model, adapter_name)  # leave the model as it was: no half-loaded adapter
        raise
    return config

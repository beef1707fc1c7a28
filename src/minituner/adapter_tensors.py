"""Adapter tensors as files spell them, brought to our keys: PEFT's prefix and adapter names, legacy .pt files.

Our key for a LoRA factor is ``<module path>.lora_A.weight`` / ``.lora_B.weight``; PEFT writes
``base_model.model.<module path>.lora_A.weight`` (``PEFT_PREFIX``), and in memory adds the adapter name
(``.lora_A.default.weight``). A leaf module: ``adapter_io`` and ``peft_format`` both use it.
"""
from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from minigpt.errors import InputError

PEFT_PREFIX = "base_model.model."


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


def module_paths(sd: dict[str, torch.Tensor]) -> list[str]:
    """The module paths an adapter's keys name, in key order."""
    return list(dict.fromkeys(k.rsplit(".lora_", 1)[0] for k in sd if ".lora_" in k))


def check_rank_held(sd: dict[str, torch.Tensor], r: int, path: Path) -> None:
    """InputError where a factor's rank is not the r an adapter's config records (a config edited, or tensors of
    another adapter): alpha / r would scale its update by another r than the one it was trained with."""
    for key, t in sd.items():
        if t.dim() == 2 and key.endswith((".lora_A.weight", ".lora_B.weight")):
            rank = t.shape[0] if key.endswith(".lora_A.weight") else t.shape[1]
            if rank != r:
                raise InputError(f"{path}: damaged adapter: its config records r {r}, {key} has rank {rank}")

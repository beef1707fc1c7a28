"""Adapter files: minituner's own safetensors format, legacy ``.pt`` files, and loading any of them.

Format ``minituner-lora-v1``: one safetensors file whose keys are ``<module path>.lora_A.weight``
(r × in) and ``<module path>.lora_B.weight`` (out × r), e.g. ``blocks.0.attn.q_proj.lora_A.weight``
(PEFT's keys without the ``base_model.model.`` prefix), and whose metadata holds the LoRAConfig
(``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules`` as JSON), for a QLoRA adapter
the ``quant_scheme`` its targets were quantized by, and the ``base_sha256`` of the weights its run trained on
(``minituner.run_record.check_run_base`` reads it where the file travels without its run's manifest).
A ``.pt`` / ``.pth`` / ``.bin`` adapter is read only with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.errors import InputError
from minigpt.io import atomic_save_safetensors, load_safetensors
from minigpt.train_state import FORMAT as CHECKPOINT_FORMAT
from miniquant import QuantizedLinear

from .adapter_tensors import check_rank_held, load_pickled_tensors, module_paths, normalize_keys
from .lora import (LoRAConfig, adapter_config, apply_lora, linear_candidates, load_lora_state_dict, lora_state_dict,
                   mismatch_error)
from .peft_format import CONFIG_NAME, peft_selection, read_peft_adapter, targets_name
from .zoo import delete_adapter

FORMAT = "minituner-lora-v1"
ADAPTER_FILE = "adapter_final.safetensors"
PICKLE_SUFFIXES = {".pt", ".pth", ".bin"}


def save_adapter(model: nn.Module, path: str | Path, adapter_name: str | None = None,
                 base_sha256: str | None = None) -> Path:
    """Write one adapter in minituner-lora-v1 (atomically), with the base's sha256 where given; return the path."""
    path = Path(path)
    cfg = adapter_config(model, adapter_name)
    meta = {"format": FORMAT, "r": str(cfg.r), "lora_alpha": repr(float(cfg.alpha)),
            "lora_dropout": repr(float(cfg.dropout)), "use_rslora": json.dumps(cfg.use_rslora),
            "target_modules": json.dumps(cfg.target_modules)}
    schemes = {m.scheme for m in model.modules() if isinstance(m, QuantizedLinear)}
    if len(schemes) == 1:  # QLoRA: the scheme its targets were quantized by, for a file read without its run
        meta["quant_scheme"] = schemes.pop()
    if base_sha256:
        meta["base_sha256"] = base_sha256
    atomic_save_safetensors(lora_state_dict(model, adapter_name), path, metadata=meta)
    return path


def adapter_file_scheme(path: str | Path) -> str | None:
    """The quant_scheme a minituner adapter file (or a folder holding one) records: the QLoRA run's; None for a
    LoRA adapter, an older file, a PEFT folder or a legacy file."""
    return _adapter_file_field(path, "quant_scheme")


def adapter_file_base(path: str | Path) -> str | None:
    """The base_sha256 a minituner adapter file (or a folder holding one) records: the weights its run trained
    on; None for an older file, a PEFT folder or a legacy file."""
    return _adapter_file_field(path, "base_sha256")


def _adapter_file_field(path: str | Path, key: str) -> str | None:
    path = Path(path)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.is_file() or path.suffix.lower() != ".safetensors":
        return None
    return read_metadata(path).get(key) or None


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


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], LoRAConfig | None]:
    """Tensors (in our key format) and, when the file records one, the LoRAConfig of an adapter.

    `path` may be a minituner run folder, a PEFT folder, a .safetensors file or a legacy .pt file.
    """
    path = Path(path)
    if _is_peft_folder(path):
        return read_peft_adapter(path)
    if path.is_dir():
        if not (path / ADAPTER_FILE).is_file():
            raise InputError(f"{path}: no {ADAPTER_FILE} or {CONFIG_NAME} in this folder")
        path = path / ADAPTER_FILE
    if not path.exists():
        raise InputError(f"{path}: adapter file not found")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return normalize_keys(load_pickled_tensors(path)), None
    meta = read_metadata(path)
    if meta.get("format") == CHECKPOINT_FORMAT:  # a run's checkpoints/step-N.safetensors: optimizer state too
        raise InputError(f"{path}: a training checkpoint (the trained tensors with the optimizer's state), not an "
                         f"adapter: give the run's folder or its {ADAPTER_FILE}; finetune --resume continues from it")
    sd = normalize_keys(load_safetensors(path))
    cfg = config_from_metadata(meta, path)
    if cfg is not None:
        _check_tensors_match_metadata(sd, cfg, path)
        check_rank_held(sd, cfg.r, path)
    return sd, cfg


def _is_peft_folder(path: Path) -> bool:
    """A folder holding a PEFT adapter and not a minituner run's (which may hold both: ours is read)."""
    return path.is_dir() and not (path / ADAPTER_FILE).is_file() and (path / CONFIG_NAME).is_file()


def _check_tensors_match_metadata(sd: dict[str, torch.Tensor], cfg: LoRAConfig, path: Path) -> None:
    """InputError where a minituner adapter file's tensors and its metadata's target_modules (the paths its run
    wrapped, ``adapter_config``) name different modules: a file cut short or pieced together."""
    held, named = module_paths(sd), list(cfg.target_modules)
    held_set, named_set = set(held), set(named)
    lacking = [p for p in named if p not in held_set]
    unnamed = [p for p in held if p not in named_set]
    if lacking:
        raise InputError(f"{path}: damaged adapter: its metadata names {len(lacking)} module(s) it holds no tensors "
                         f"for ({_first(lacking)})")
    if unnamed:
        raise InputError(f"{path}: damaged adapter: it holds tensors for {len(unnamed)} module(s) its metadata "
                         f"does not name ({_first(unnamed)})")


def check_same_scaling(path: str | Path, lora: LoRAConfig) -> None:
    """InputError where the adapter at `path` (finetune's --init-adapter) records another rank, alpha or rsLoRA than
    the run's `lora`: started from with those, its update alpha / r (or alpha / sqrt(r)) would not be the one it was
    trained with. An adapter that records no config (a .pt file) is not checked."""
    recorded = read_adapter(path)[1]
    if recorded is None:
        return
    differ = [f"{name} {mine} (the adapter's {theirs})" for name, mine, theirs in (
        ("rank", lora.r, recorded.r), ("alpha", float(lora.alpha), recorded.alpha),
        ("use_rslora", lora.use_rslora, recorded.use_rslora)) if mine != theirs]
    if differ:
        raise InputError(f"--init-adapter {path}: this run's {', '.join(differ)} would scale the adapter's update "
                         "otherwise than it was trained: give the adapter's values (--rank, --alpha, --use-rslora)")


def _first(paths: list[str]) -> str:
    return paths[0] + (", ..." if len(paths) > 1 else "")


def _check_targets_held(sd: dict[str, torch.Tensor], selects: Callable[[str], bool],
                        candidates: dict[str, nn.Module], path: Path) -> None:
    """InputError where the adapter's own selection (``_selection``) takes modules of this model that its
    tensors leave out: an adapter for a deeper model of the same widths, or one cut short. PEFT would load it with
    a warning, those modules' LoRA left at its initialization (B = 0: no change), so part of what was trained would
    be missing without a word."""
    held = set(module_paths(sd))
    lacking = [n for n in candidates if selects(n) and n not in held]
    if lacking:
        raise InputError(f"{path}: the adapter's target_modules select {len(lacking)} module(s) of this model it "
                         f"holds no tensors for ({_first(lacking)}): an adapter for another model, or one cut short")


def _selection(path: Path, sd: dict[str, torch.Tensor], cfg: LoRAConfig, model: nn.Module) -> Callable[[str], bool]:
    """path -> whether the adapter at `path` puts LoRA on that module of `model`, as its config selects them: a
    PEFT folder's as PEFT does (``peft_format.peft_selection``: null target_modules, exclude_modules), ours by the
    paths its metadata names."""
    if _is_peft_folder(path):
        return peft_selection(path, model, module_paths(sd))
    return partial(targets_name, cfg.target_modules)


def load_adapter(model: nn.Module, path: str | Path, config: LoRAConfig | None = None,
                 adapter_name: str = "default") -> LoRAConfig:
    """Wrap `model` with the adapter stored at `path` and load its tensors (strict: names bad keys).

    Without `config` the file's own r/alpha are used and the targets are the modules its keys name;
    keys for modules this model lacks are reported as unexpected, and modules of this model that the file's own
    target_modules select but its tensors leave out are refused. `config` (needed for a .pt file,
    which records none) is used as given, so a different rank or target set is reported by key.
    """
    sd, file_cfg = read_adapter(path)
    if not sd:
        raise InputError(f"{path}: the adapter holds no tensors")
    if config is None:
        if file_cfg is None:
            raise InputError(f"{path}: the file records no LoRA config (r, alpha); pass one")
        candidates = linear_candidates(model)
        present = [p for p in module_paths(sd) if p in candidates]
        if not present:
            raise mismatch_error([], sorted(sd), [])
        _check_targets_held(sd, _selection(Path(path), sd, file_cfg, model), candidates, Path(path))
        config = replace(file_cfg, target_modules=present)
    apply_lora(model, config, adapter_name)
    try:
        load_lora_state_dict(model, sd, strict=True, adapter_name=adapter_name)
    except InputError:
        delete_adapter(model, adapter_name)  # leave the model as it was: no half-loaded adapter
        raise
    return config


def load_peft_adapter(model: nn.Module, folder: str | Path, adapter_name: str = "default") -> LoRAConfig:
    """Wrap `model` with the adapter in a PEFT folder (ours or PEFT's) and load it; names bad keys."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise InputError(f"{folder}: not a PEFT adapter folder (no {CONFIG_NAME})")
    return load_adapter(model, folder, adapter_name=adapter_name)

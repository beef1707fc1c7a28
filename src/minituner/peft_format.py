"""PEFT-format adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are ``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight`` (PEFT drops the adapter
name when saving), so ``peft.PeftModel.from_pretrained(<a MiniGPT>, folder)`` loads what we write, and
we load what PEFT writes. Only plain LoRA is understood: any other feature of PEFT's LoraConfig that is on (DoRA,
per-module rank/alpha patterns, LoRA biases, extra saved modules, a subset of layers, activated LoRA, an
initialization that changed the base such as PiSSA, and any field this file does not know) is refused with a
one-line error rather than silently dropped, and so is an adapter for another task than a causal LM
(``task_type``). The tensors say which modules get LoRA; each must be one the config's ``target_modules`` select
as PEFT matches them (``targets_name``), less its ``exclude_modules``, since PEFT would leave the others out, and
every module of the model so selected must have its tensors (``peft_selection``, applied where the model is known).
``target_modules`` null is PEFT's default for the base's model type (q_proj and v_proj for Llama, Mistral and
Qwen2); a MiniGPT has none, as PEFT then asks for target_modules.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.decoder import Decoder
from minigpt.errors import InputError
from minigpt.io import atomic_save_safetensors, load_safetensors, read_json, same_json, write_json

from .adapter_tensors import PEFT_PREFIX, check_rank_held, load_pickled_tensors, module_paths, normalize_keys
from .lora import ALL_LINEAR, LoRAConfig, adapter_config, lora_modules, lora_state_dict

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"


def peft_target_modules(model: nn.Module, paths: list[str]) -> list[str]:
    """Leaf names (q_proj, ...) when PEFT's suffix matching would pick exactly `paths`, else the full paths."""
    inside = tuple(f"{p}." for p in lora_modules(model))
    leaves = {p.rsplit(".", 1)[-1] for p in paths}
    picked = {n for n, _ in model.named_modules() if n and not n.startswith(inside) and n.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if picked == set(paths) else sorted(paths)


def peft_config_dict(model: nn.Module, adapter_name: str | None = None, base_model_name_or_path: str | None = None) -> dict:
    cfg = adapter_config(model, adapter_name)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if isinstance(model, Decoder) else None,  # PEFT's word for a Hugging Face LM
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": peft_target_modules(model, list(cfg.target_modules)),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


def save_peft_adapter(model: nn.Module, folder: str | Path, adapter_name: str | None = None,
                      base_model_name_or_path: str | None = None) -> Path:
    """Write a PEFT adapter folder (weights first, config last: a folder with a config is complete)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: exists and is not a folder")
    config = peft_config_dict(model, adapter_name, base_model_name_or_path)
    tensors = {PEFT_PREFIX + k: v for k, v in lora_state_dict(model, adapter_name).items()}
    atomic_save_safetensors(tensors, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    write_json(folder / CONFIG_NAME, config)
    return folder


# adapter_config.json's fields read here, and those that change nothing in a saved adapter's product (bookkeeping,
# or settings used only beside a feature that must be off); every other field of PEFT's LoraConfig, and any a
# later PEFT adds, must hold its off value (FEATURE_OFF), or the adapter is refused: DoRA, per-module ranks, LoRA
# biases, saved modules, a subset of layers, activated LoRA (alora_invocation_tokens: the adapter applied only
# after given tokens), parameter targets and the rest all compute something plain LoRA does not
READ_FIELDS = {"peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
               "use_rslora", "init_lora_weights"}
INERT_FIELDS = {"auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
                "runtime_config", "ensure_weight_tying",
                "megatron_core",  # the module megatron_config names (that must be off)
                "qalora_group_size",  # used with use_qalora only (that must be off)
                "eva_config"}  # EVA's initialization: the saved factors are what it made
FEATURE_OFF = (None, False, {}, [], "none")  # what PEFT writes for a feature not used (bias: "none")
# init_lora_weights that leave the base as it was; PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA train on a base they
# changed (the residual of W), which an adapter saved without PEFT's conversion needs
PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva")
# what PEFT puts LoRA on when target_modules is null: its default for the base's model type (peft.utils.constants'
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), for the Hugging Face families minituner.hf_load builds
PEFT_DEFAULT_TARGETS = {"llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"]}
TASK_TYPES = (None, "CAUSAL_LM")  # a causal LM's adapter (None: a plain nn.Module's, as PEFT writes for MiniGPT)


def targets_name(targets: str | list[str], path: str) -> bool:
    """Whether PEFT's target_modules select the module at `path`: a list by name or path suffix ('q_proj' selects
    'model.layers.0.self_attn.q_proj'), a string as a regular expression over the whole path, 'all-linear' every
    Linear (the tensors' modules are Linears)."""
    if isinstance(targets, str):
        return targets.lower() == ALL_LINEAR or re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def _field(d: dict, key: str, kinds: type | tuple[type, ...], where: Path, default=None):
    """d[key] when it has a JSON type of `kinds` (a string "4" or "false" is not read as 4 or True, a bool is not
    a number, 4.7 is not rounded to a rank); InputError naming the field otherwise."""
    if key not in d or d[key] is None:
        if default is None:
            raise InputError(f"{where}: no {key!r} in the adapter config")
        return default
    value = d[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        kind = "true or false" if bool in kinds else "a number" if float in kinds else "an integer"
        raise InputError(f"{where}: {key} must be {kind}, got {value!r}")
    return value


def config_from_peft(d: dict, where: Path) -> LoRAConfig:
    if d.get("peft_type") != "LORA":
        raise InputError(f"{where}: peft_type is {d.get('peft_type')!r}, only LORA adapters are supported")
    if d.get("task_type") not in TASK_TYPES:
        raise InputError(f"{where}: task_type {d['task_type']!r} is not supported (a causal language model's "
                         "adapter: CAUSAL_LM)")
    for key, value in d.items():
        if key not in READ_FIELDS | INERT_FIELDS and not any(same_json(value, off) for off in FEATURE_OFF):
            raise InputError(f"{where}: {key}={value!r} is not supported (plain LoRA only)")
    init = d.get("init_lora_weights", True)
    if not any(same_json(init, p) for p in PLAIN_INITS):
        raise InputError(f"{where}: init_lora_weights={init!r} trains on a base PEFT changed (the residual of its "
                         "weights): convert the adapter to plain LoRA with PEFT first (save_pretrained with "
                         "path_initial_model_for_weight_conversion)")
    targets = ALL_LINEAR if d.get("target_modules") is None else d["target_modules"]  # [] is refused below
    for key, value in (("target_modules", targets), ("exclude_modules", d.get("exclude_modules") or [])):
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(t, str) for t in value)):
            raise InputError(f"{where}: {key} must be a string or a list of strings, got {value!r}")
    try:
        cfg = LoRAConfig(r=_field(d, "r", int, where), alpha=float(_field(d, "lora_alpha", (int, float), where)),
                         dropout=float(_field(d, "lora_dropout", (int, float), where, 0.0)), target_modules=targets,
                         use_rslora=_field(d, "use_rslora", bool, where, False))
    except OverflowError as e:  # an integer too large for a float
        raise InputError(f"{where}: bad LoRA fields ({e})") from None
    cfg.validate()
    return cfg


def read_peft_adapter(folder: str | Path) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Tensors keyed '<module path>.lora_A.weight' (prefix and adapter name removed) and the LoRAConfig."""
    folder = Path(folder)
    d = read_json(folder / CONFIG_NAME)
    cfg = config_from_peft(d, folder / CONFIG_NAME)
    if (folder / WEIGHTS_NAME).is_file():
        sd = load_safetensors(folder / WEIGHTS_NAME)
    elif (folder / LEGACY_WEIGHTS_NAME).is_file():
        sd = load_pickled_tensors(folder / LEGACY_WEIGHTS_NAME)
    else:
        raise InputError(f"{folder}: no {WEIGHTS_NAME} beside {CONFIG_NAME}")
    sd = normalize_keys(sd)
    check_rank_held(sd, cfg.r, folder)
    held = module_paths(sd)
    if d.get("target_modules") is not None:  # null: PEFT's default for the model type, checked by peft_selection
        check_selected(held, _peft_selection(d["target_modules"], d, folder / CONFIG_NAME), d, folder)
    if d.get("target_modules") is None or d.get("exclude_modules"):
        # null or a selection with exclusions: the tensors' own modules stand for it (peft_selection has PEFT's)
        cfg = replace(cfg, target_modules=held)
    return sd, cfg


def peft_selection(folder: Path, model: nn.Module, held: list[str]) -> Callable[[str], bool]:
    """path -> whether PEFT puts LoRA on that module of `model` for the adapter in `folder`, whose tensors adapt
    `held`: its target_modules (null: PEFT's default for the model's type, ``PEFT_DEFAULT_TARGETS``) less its
    exclude_modules. InputError for a null target_modules on a model PEFT has no default for (a MiniGPT: PEFT asks
    for target_modules), or for tensors of modules outside the selection, which PEFT would leave out."""
    where = folder / CONFIG_NAME
    d = read_json(where)
    if d.get("target_modules") is not None:  # (its tensors checked against it by read_peft_adapter)
        return _peft_selection(d["target_modules"], d, where)
    model_type = model.config.model_type if isinstance(model, Decoder) else None
    if model_type not in PEFT_DEFAULT_TARGETS:
        raise InputError(f"{where}: target_modules is null, which PEFT replaces by its default for the base's "
                         "model type, and it has none for a MiniGPT: name the adapted modules in target_modules")
    selects = _peft_selection(PEFT_DEFAULT_TARGETS[model_type], d, where)
    check_selected(held, selects, d, folder)
    return selects


def check_selected(held: list[str], selects: Callable[[str], bool], d: dict, folder: Path) -> None:
    """InputError where the tensors adapt modules the config's selection leaves out (PEFT would drop them)."""
    unselected = [p for p in held if not selects(p)]
    if unselected:
        targets = d.get("target_modules")
        chosen = (f"target_modules {targets!r}" if targets is not None else "target_modules null (PEFT's default "
                  "for the model type)") + (f" less exclude_modules {d['exclude_modules']!r}"
                                            if d.get("exclude_modules") else "")
        raise InputError(f"{folder}: its tensors adapt {len(unselected)} module(s) that {CONFIG_NAME}'s {chosen} does "
                         f"not select ({unselected[0]}{', ...' if len(unselected) > 1 else ''}); PEFT would leave "
                         "them out: select them there, or remove their tensors")


def _peft_selection(targets: str | list[str], d: dict, where: Path) -> Callable[[str], bool]:
    """path -> whether PEFT puts LoRA on that module: `targets` select it (``targets_name``) and d's
    exclude_modules, matched the same way, do not; InputError for a string that is no regular expression."""
    exclude = d.get("exclude_modules") or None
    for key, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if isinstance(value, str) and value.lower() != ALL_LINEAR:
            try:
                re.compile(value)
            except re.error as e:
                raise InputError(f"{where}: {key} {value!r} is not a regular expression ({e})") from None
    return lambda path: targets_name(targets, path) and not (exclude and targets_name(exclude, path))

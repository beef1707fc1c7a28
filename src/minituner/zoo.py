"""An adapter zoo: several named LoRA adapters on one base, hot-swapped without reloading the base.

    apply_lora(model, cfg_a, "a"); apply_lora(model, cfg_b, "b")   # two adapters, one base
    set_adapter(model, "a")                    # base + a
    set_adapter(model, {"a": 0.5, "b": 0.5})   # base + 0.5·a + 0.5·b, computed on the fly
    with adapters_disabled(model): ...         # the base alone
    combine_adapters(model, {"a": 0.5, "b": 0.5}, "ab")  # the same sum as one saveable adapter
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
import torch.nn as nn

from minigpt.errors import InputError

from .lora import activate, adapter_config, adapter_names, lora_modules


def set_adapter(model: nn.Module, adapter: str | Mapping[str, float]) -> None:
    """Switch the active adapter (or a weighted set of them); only the active ones stay trainable."""
    weights = {adapter: 1.0} if isinstance(adapter, str) else dict(adapter)
    names = adapter_names(model)
    unknown = sorted(set(weights) - set(names))
    if unknown or not weights:
        raise InputError(f"no adapter named {unknown or '(none given)'}; adapters: {names}")
    activate(model, weights)


def active_adapters(model: nn.Module) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in lora_modules(model).values():
        out.update(m.active_adapters)
    return out


def disable_adapters(model: nn.Module, disabled: bool = True) -> None:
    """disabled=True: every LoRALinear returns its base layer's output (the adapters stay loaded)."""
    mods = lora_modules(model).values()
    if any(m.merged_adapters for m in mods):
        raise InputError("adapters are merged into the base weights; unmerge before disabling them")
    for m in mods:
        m.disabled = disabled


def enable_adapters(model: nn.Module) -> None:
    disable_adapters(model, False)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """`with adapters_disabled(model):` runs the base alone, then restores the adapters."""
    disable_adapters(model, True)
    try:
        yield model
    finally:
        disable_adapters(model, False)


def delete_adapter(model: nn.Module, name: str) -> None:
    if name not in adapter_names(model):
        raise InputError(f"no adapter named {name!r}; adapters: {adapter_names(model)}")
    for m in lora_modules(model).values():
        if name in m.lora_A:
            m.delete_adapter(name)


def combine_adapters(model: nn.Module, weights: Mapping[str, float], new_name: str) -> None:
    """Add `new_name` = Σ w_i·ΔW_i as one adapter of rank R = Σ r_i (PEFT's "cat"): exact, not an approximation.

    A = [A_1; A_2; ...] (R × in), B = [w_1·s_1·B_1, w_2·s_2·B_2, ...] (out × R), alpha = R so scaling is 1.
    A module that lacks one of the adapters gets zero blocks in its place, so R is the same everywhere
    and the result saves as one plain LoRA adapter (ours or PEFT's format).
    """
    names = adapter_names(model)
    unknown = sorted(set(weights) - set(names))
    if unknown or not weights:
        raise InputError(f"cannot combine {unknown or '(no adapters)'}; adapters: {names}")
    if new_name in names:
        raise InputError(f"adapter {new_name!r} already exists")
    ranks = {n: adapter_config(model, n).r for n in weights}
    rank = sum(ranks.values())
    mods = {p: m for p, m in lora_modules(model).items() if any(n in m.lora_A for n in weights)}
    for path, m in mods.items():
        if rank > min(m.in_features, m.out_features):
            raise InputError(f"combined rank {rank} exceeds min(in, out) = {min(m.in_features, m.out_features)} of {path}")
    for m in mods.values():
        a_blocks, b_blocks = [], []
        for n, r in ranks.items():
            if n in m.lora_A:
                a_blocks.append(m.lora_A[n].weight.detach())
                b_blocks.append(m.lora_B[n].weight.detach() * (weights[n] * m.scaling[n]))
            else:
                a_blocks.append(torch.zeros(r, m.in_features, device=m.lora_A[next(iter(m.lora_A))].weight.device))
                b_blocks.append(torch.zeros(m.out_features, r, device=a_blocks[-1].device))
        m.add_adapter(new_name, rank, float(rank))
        with torch.no_grad():
            m.lora_A[new_name].weight.copy_(torch.cat(a_blocks, dim=0))  # (R, in)
            m.lora_B[new_name].weight.copy_(torch.cat(b_blocks, dim=1))  # (out, R)
        m.lora_A[new_name].weight.requires_grad_(False)
        m.lora_B[new_name].weight.requires_grad_(False)


def zoo_summary(model: nn.Module) -> list[dict]:
    """One row per adapter: name, r, alpha, number of wrapped modules, whether active."""
    active = active_adapters(model)
    rows = []
    for name in adapter_names(model):
        cfg = adapter_config(model, name)
        rows.append({"name": name, "r": cfg.r, "alpha": cfg.alpha, "modules": len(cfg.target_modules),
                     "active_weight": active.get(name, 0.0)})
    return rows

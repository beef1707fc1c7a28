"""QLoRA checked against the float model: what a wrapped layer holds, the logit error of each scheme and of
each layer alone, and an adapter swap that must leave the quantized base bit-identical.

The functions take models (or a factory for fresh ones) and tensors; Lab 03 calls them and renders the numbers.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn

from .lora import LoRAConfig, load_lora_state_dict, lora_modules
from .parity import bnb_nf4_max_logit_diff
from .planner import lora_trainable_params, minigpt_shape, nf4_weight_bytes, quantized_params, total_params
from .qlora import (compare_logits, param_summary, print_trainable_parameters, quantize_linears, quantized_modules,
                    weight_errors)
from .zoo import adapters_disabled, set_adapter

Evaluate = Callable[[nn.Module], float]  # a model -> its validation loss


def wrapped_layer(model: nn.Module, path: str, lora: LoRAConfig) -> dict:
    """What the Linear at `path` has become, and the model's counts beside the planner's."""
    q = model.get_submodule(path)
    shape, targets = minigpt_shape(model.config), lora.target_modules
    lines: list[str] = []
    print_trainable_parameters(model, log=lines.append)
    return {
        "q_proj": str(q),
        "q_proj_types": [type(q).__name__, type(q.base_layer).__name__],
        "q_proj_buffers": {n: [list(b.shape), str(b.dtype).removeprefix("torch.")]
                           for n, b in q.base_layer.named_buffers()},
        "q_proj_base_parameters": sum(1 for _ in q.base_layer.parameters()),
        "quantized_layers": len(quantized_modules(model)),
        "summary_text": lines[0],
        "summary": param_summary(model).to_dict(),
        "planner": {"base": total_params(shape), "trainable": lora_trainable_params(shape, lora.r, targets),
                    "quantized": quantized_params(shape, targets),
                    "quantized_bytes": nf4_weight_bytes(shape, False, targets)},
    }


@torch.no_grad()
def scheme_rows(plain: nn.Module, ref: torch.Tensor, ref_base: torch.Tensor, build: Callable[[str], nn.Module],
                adapter: dict[str, torch.Tensor], schemes: tuple[str, ...], x: torch.Tensor,
                evaluate: Evaluate) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Per scheme: a fresh quantized model (`build(scheme)`) with `adapter` loaded, against the float reference
    logits `ref` (with the adapter) and `ref_base` (without); returns the rows and each scheme's logits."""
    rows, logits_by_scheme = [], {}
    for scheme in schemes:
        model = build(scheme)
        load_lora_state_dict(model, adapter)
        errs = weight_errors(plain, model)
        logits = model(x)
        with adapters_disabled(model):
            base_only = model(x)
        logits_by_scheme[scheme] = logits
        rows.append({"scheme": scheme, "weight_error": sum(errs.values()) / len(errs),
                     "with_adapter": compare_logits(ref, logits), "base_only": compare_logits(ref_base, base_only),
                     "val_loss": evaluate(model)})
    return rows, logits_by_scheme


@torch.no_grad()
def single_linear_ratios(fresh: Callable[[], nn.Module], paths: list[str], scheme: str, x: torch.Tensor,
                         ref: torch.Tensor) -> dict[str, float]:
    """Logit error ratio with one LoRA-wrapped Linear quantized at a time (`fresh()`: float model + adapter)."""
    out = {}
    for path in paths:
        model = fresh()
        quantize_linears(model, [f"{path}.base_layer"], scheme)
        out[path] = compare_logits(ref, model(x))["ratio"]
    return out


def quantized_fingerprint(model: nn.Module) -> str:
    """sha256 over every quantized tensor (codes and scales) with its layer's path: equal iff the base is."""
    h = hashlib.sha256()
    for path, q in quantized_modules(model).items():
        for t in q.quantized_tensors():
            h.update(path.encode() + t.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def adapter_swap(model: nn.Module, names: tuple[str, str], x: torch.Tensor, evaluate: Evaluate) -> dict:
    """Switch between two adapters on one quantized base; their outputs, and whether the base stayed identical."""
    before = quantized_fingerprint(model)
    out = {}
    for name in names:
        set_adapter(model, name)
        logits = model(x)
        out[name] = {"logits": logits, "finite": bool(torch.isfinite(logits).all()), "val_loss": evaluate(model)}
    diff = compare_logits(out[names[0]]["logits"], out[names[1]]["logits"])
    return {"adapters": {n: {k: v for k, v in o.items() if k != "logits"} for n, o in out.items()},
            "diff": diff, "differ": diff["mean_abs_diff"] > 0,
            "base_unchanged": before == quantized_fingerprint(model), "base_fingerprint": before}


def sensitivity(single: dict[str, float]) -> dict:
    """Summary of single_linear_ratios: median, range, the most sensitive layer, and the quadrature sum."""
    v = sorted(single.values())
    return {"median": (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2, "single_lo": v[0], "single_hi": v[-1],
            "worst": max(single, key=single.get), "quadrature": math.sqrt(sum(x * x for x in v))}


def logit_check(plain: nn.Module, with_adapter: Callable[[], nn.Module], build: Callable[[str], nn.Module],
                adapter: dict[str, torch.Tensor], schemes: tuple[str, ...], x: torch.Tensor, evaluate: Evaluate,
                tolerance: float) -> dict:
    """An adapter on the float base against the same adapter on quantized bases (the last of `schemes` is the
    one checked against `tolerance`): logits on `x`, weight errors, val loss, each layer alone, bitsandbytes."""
    fp = with_adapter()
    with torch.no_grad():
        ref, ref_base = fp(x), plain(x)
    rows, logits = scheme_rows(plain, ref, ref_base, build, adapter, schemes, x, evaluate)
    single = single_linear_ratios(with_adapter, list(lora_modules(fp)), schemes[-1], x, ref)
    checked = rows[-1]["with_adapter"]
    return {"prompts": list(x.shape), "tolerance": tolerance, "ratio": checked["ratio"],
            "within_tolerance": checked["ratio"] <= tolerance, "fp_val_loss": evaluate(fp), "schemes": rows,
            "single_linear": single,
            "bitsandbytes_max_abs_diff": bnb_nf4_max_logit_diff(with_adapter(), x, logits[schemes[-1]])}

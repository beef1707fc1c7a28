"""The memory of the run `finetune --base FOLDER` makes on CPU, planned before it trains: the second table of
`count --base`, and the line `finetune` logs (and writes to manifest.json) before its first step.

It is memory-check's prediction (``memory.check.predict``) for that run: the weights as load_base keeps them (a
16-bit checkpoint's parts stay 16-bit for LoRA and QLoRA; full fine-tuning reads float32), the regime
build_for_training makes, --precision's widths, AdamW, and the step's peak of planner/peak.py at one batch
(sequences, positions, targets counted: for a run, the largest batch its data makes, ``sft.largest_batch``).
The process itself (Python, torch, allocator slack) comes on top and is not included.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from minigpt.distributed import world_size
from minigpt.errors import InputError
from miniquant import DEFAULT_QUANT_SCHEME

from ..base_model import model_config, stored_dtype, stored_part_dtypes
from ..planner.memory import Regime
from ..planner.report import UNITS
from ..sft import LargestBatch
from .available import available_memory
from ..dropout import config_dropout
from .check import JSON_BUCKETS, CheckConfig, predict


def counted_phrase(batch_size: int, seq_len: int, counted: int) -> str:
    """"n of N targets counted" for a batch where not every target counts; "" where every one does."""
    every = batch_size * seq_len
    return "" if counted == every else f"{counted:,} of {every:,} targets counted"


def finetune_plan(folder: Path, regimes: Sequence[Regime], targets: str, batch_size: int, seq_len: int,
                  grad_checkpoint: bool, counted_targets: int | None = None, precision: str = "fp32",
                  lora_dropout: float = 0.0, model_dropout: float | None = None, grad_accum: int = 1) -> dict:
    """The run `finetune --base folder` makes on CPU at `precision`, regime by regime, as memory-check predicts it
    (bytes per bucket, the step's peak and its phase); the process itself is not included. The model trains with
    `model_dropout` (finetune's --model-dropout), by default its config's (GPT-2's 0.1: masks, and attention's h·T²
    probabilities on SDPA's math path), LoRA with `lora_dropout`. A Decoder trained with attention dropout is an
    InputError (not modelled). `grad_accum` batches make a step (their gradients adding up)."""
    cfg, base_dtype, parts = model_config(folder), stored_dtype(folder), stored_part_dtypes(folder)
    dropout = config_dropout(cfg) if model_dropout is None else model_dropout
    rows = []
    for r in regimes:
        check = CheckConfig(regime=r.name, rank=r.rank or 1, targets=targets, batch_size=batch_size, seq_len=seq_len,
                            grad_checkpoint=grad_checkpoint, counted_targets=counted_targets, precision=precision,
                            grad_accum=grad_accum,
                            allow_slow_bf16=True,  # the plan of such a run, not the run: no refusal here
                            model_dropout=dropout, lora_dropout=lora_dropout if r.name != "full" else 0.0)
        predicted, _, phase, _ = predict(cfg, check, folder.name, base_dtype=parts or base_dtype)
        rows.append({"regime": r.label, **{k: predicted[k] for k in JSON_BUCKETS}, "peak_phase": phase})
    mixed = {} if len(set(parts.values())) < 2 else {
        "stored_dtypes": {part: str(d).removeprefix("torch.") for part, d in parts.items()}}
    return {"base_dtype": str(base_dtype).removeprefix("torch."), **mixed, "precision": precision, "device": "cpu",
            "batch_size": batch_size, "seq_len": seq_len, "counted_targets": counted_targets or batch_size * seq_len,
            "grad_accum": grad_accum,
            "model_dropout": dropout, "lora_dropout": lora_dropout, "regimes": rows}


def plan_run(folder: Path, regime: Regime, targets: str | list[str], batch: LargestBatch, grad_checkpoint: bool,
             precision: str, device: torch.device, quant_scheme: str | None = None,
             lora_dropout: float = 0.0, model_dropout: float | None = None,
             grad_accum: int = 1) -> tuple[dict | None, str]:
    """(the plan, "") of one finetune run at its data's largest batch, or (None, why) for a run the planner does
    not model: on CUDA (LoRA computes in the checkpoint's dtype there), under torchrun (each
    rank's shard and DDP's gradient buckets), with another quantization than NF4 in blocks of 64, for a llama-family
    config with attention dropout, or with targets given as module paths."""
    if device.type != "cpu":
        return None, f"not made for {device.type} (the planner models finetune's CPU runs; memory-check --device " \
                     f"{device.type} measures one)"
    if world_size() > 1:
        return None, "not made under torchrun (each rank trains its shard of the batch beside DDP's buckets)"
    if regime.name == "qlora" and quant_scheme != DEFAULT_QUANT_SCHEME:
        return None, f"not made for {quant_scheme} (the planner counts QLoRA as {DEFAULT_QUANT_SCHEME})"
    names = targets if isinstance(targets, str) else ",".join(targets)
    try:
        plan = finetune_plan(folder, [regime], names, batch.batch_size, batch.seq_len, grad_checkpoint, batch.counted,
                             precision, lora_dropout, model_dropout, grad_accum)
    except InputError as e:  # a Decoder's attention dropout, targets given as paths (the planner takes names)
        return None, f"not made, the planner cannot count this run: {e}"
    row = plan.pop("regimes")[0]
    available = available_memory()
    return {**plan, **row, "mean_counted": batch.mean_counted, "available_bytes": available.bytes,
            "available_limit": available.limit}, ""


def describe_run_plan(plan: dict | None, why: str) -> list[str]:
    """The lines finetune logs: the planned peak and what it is planned for, and a warning when what it adds to
    the weights already loaded exceeds the memory available now (``available.available_memory``: the system's, or a
    cgroup's headroom where its memory limit leaves less)."""
    if plan is None:
        return [f"memory plan: {why}"]
    counted = counted_phrase(plan["batch_size"], plan["seq_len"], plan["counted_targets"])
    counted = counted and f", {counted}"
    unit = "GiB" if plan["peak"] >= UNITS["GiB"] else "MiB"
    lines = [f"memory plan: step peak {plan['peak'] / UNITS[unit]:,.2f} {unit} at the {plan['peak_phase']} "
             f"(planner/peak.py; the process itself comes on top) for the largest batch of the data, "
             f"{plan['batch_size']} x {plan['seq_len']}{counted}{_accumulated(plan)}; "
             f"{plan['available_bytes'] / UNITS['GiB']:,.1f} GiB "
             f"available now{_limit(plan)}"]
    if plan["peak"] - plan["weights"] > plan["available_bytes"]:  # the weights are loaded already
        dropout = ", or without the model's dropout (--model-dropout 0)" if plan.get("model_dropout") else ""
        lines.append("warning: the planned peak, beyond the weights already loaded, exceeds the memory available "
                     f"now{_limit(plan) or ' (psutil)'}: lower --batch-size or --seq-len, "
                     f"or train with --grad-checkpoint or --qlora{dropout} "
                     "(minituner count --base ... --data ... compares them)")
    return lines


def _accumulated(plan: dict) -> str:
    n = plan.get("grad_accum", 1)
    return f", {n} of them a step (gradient accumulation)" if n > 1 else ""


def _limit(plan: dict) -> str:
    limit = plan.get("available_limit", "the system's")
    return "" if limit == "the system's" else f" under {limit}"

"""Exact bytes of one LoRA/QLoRA setup after a few AdamW steps, measured in a fresh Python process.

A fresh process per setup keeps one setup's allocations (and PyTorch's one-time buffers) out of the next
one's RSS. ``measure_in_fresh_process(spec)`` runs ``python -m minituner.memory.fresh_run <spec as JSON>``,
which builds the setup with ``build_for_training``, loads the adapter, trains ``steps`` steps with
``accounting.measure_training`` and prints its snapshots as one JSON line.

Setups: "lora-fp16" (every base tensor fp16, LoRA factors fp32) and "qlora-nf4" (NF4 targets, the rest fp16).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from minigpt.data import sample_batch
from minigpt.train import lm_loss

from ..adapter_io import read_adapter
from ..base_model import load_base
from ..build import build_for_training
from ..finetune import encode_domain
from ..lora import LoRAConfig, load_lora_state_dict, lora_modules
from ..planner import MemoryConfig, Regime, lora_trainable_params, minigpt_shape, plan, preset_shape
from .accounting import account, measure_training, process_rss_bytes

SETUPS = {"lora-fp16": "lora", "qlora-nf4": "qlora"}


@dataclass(frozen=True)
class Setup:
    name: str  # a key of SETUPS
    base: str  # base folder
    adapter: str  # adapter file loaded before training
    lora: dict  # LoRAConfig.to_dict()
    data: str  # corpus the batches are drawn from (train split)
    batch_size: int
    seq_len: int
    steps: int
    seed: int
    lr: float


def measure(spec: Setup) -> dict:
    """Build the setup in this process, train spec.steps AdamW steps; snapshots, RSS before building, dtypes."""
    sd, _ = read_adapter(spec.adapter)
    model0, tok = load_base(spec.base)
    train_ids, _ = encode_domain(spec.data, tok, model0.config.block_size)
    gen = torch.Generator().manual_seed(spec.seed)
    batches = [sample_batch(train_ids, spec.batch_size, spec.seq_len, gen) for _ in range(spec.steps)]
    del model0
    rss_before = process_rss_bytes()
    model, _ = load_base(spec.base)
    build_for_training(model, SETUPS[spec.name], LoRAConfig.from_dict(spec.lora), device="cpu",
                       compute_dtype=torch.float16)  # frozen float tensors fp16, LoRA factors fp32
    load_lora_state_dict(model, sd)
    r = measure_training(model, batches, lm_loss, lr=spec.lr)
    r["rss_before_build"] = rss_before
    r["dtypes"] = sorted({str(t.dtype).removeprefix("torch.") for t in [*model.parameters(), *model.buffers()]})
    return r


def measure_in_fresh_process(spec: Setup) -> dict:
    """measure(spec) in a new Python process; its JSON result."""
    cmd = [sys.executable, "-m", "minituner.memory.fresh_run", json.dumps(asdict(spec))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 1024**2:,.3f}"


def comparison(rows: dict[str, dict], planner: dict[str, dict], lora_params: int, lora_tensors: int) -> dict:
    """Measured totals against the planner's weights + grads + Adam: fp32 LoRA factors (2 bytes more per
    parameter in weights and in grads, the planner charging fp16) and AdamW's 4-byte step per tensor explain
    the whole difference when `exact` is True. RSS growth is over the reading just before building."""
    total = {k: r["after_steps"]["total"] for k, r in rows.items()}
    planned = {k: v["weights"] + v["grads"] + v["optimizer"] for k, v in planner.items()}
    lora_extra, steps_extra = 2 * lora_params, 4 * lora_tensors
    return {"total": total, "planned": planned, "lora_extra": lora_extra, "steps_extra": steps_extra,
            "extra_total": 2 * lora_extra + steps_extra,
            "exact": all(total[k] == planned[k] + 2 * lora_extra + steps_extra for k in rows),
            "rss": {k: r["after_steps"]["rss"] - r["rss_before_build"] for k, r in rows.items()}}


def comparison_table(rows: dict[str, dict], planner: dict[str, dict], labels: dict[str, str]) -> str:
    """Markdown: exact buckets, the planner's, RSS growth per setup (MiB), and the ratio of the last to the first."""
    lines = ["| regime (dtypes held) | weights MiB | grads MiB | Adam MiB | total MiB | planner weights / grads / Adam / "
             "total MiB | RSS +build MiB | RSS +2 steps MiB |", "|---|---|---|---|---|---|---|---|"]
    cells = {}
    for name, label in labels.items():
        r, p = rows[name], planner[name]
        a, planned = r["after_steps"], p["weights"] + p["grads"] + p["optimizer"]
        rss_b, rss_s = r["after_build"]["rss"] - r["rss_before_build"], a["rss"] - r["rss_before_build"]
        cells[name] = (a["weights"], a["grads"], a["optimizer"], a["total"], planned, rss_b, rss_s)
        lines.append(f"| {label} ({', '.join(r['dtypes'])}) | {mib(a['weights'])} | {mib(a['grads'])} | {mib(a['optimizer'])} "
                     f"| {mib(a['total'])} | {mib(p['weights'])} / {mib(p['grads'])} / {mib(p['optimizer'])} / {mib(planned)} "
                     f"| {mib(rss_b)} | {mib(rss_s)} |")
    lo, q = (cells[name] for name in labels)
    ratio = lambda i: f"{q[i] / lo[i]:.2f}" if lo[i] else "n/a"  # noqa: E731
    lines.append(f"| **QLoRA / LoRA** | {ratio(0)} | {ratio(1)} | {ratio(2)} | **{ratio(3)}** | {ratio(4)} (total) "
                 f"| {ratio(5)} | {ratio(6)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(measure(Setup(**json.loads(sys.argv[1])))))


def lora_vs_qlora(base, adapter, lora: LoRAConfig, data: str, memory: MemoryConfig, steps: int, train,
                  names: list[str]) -> dict:
    """Each setup of `names` ("lora-fp16", "qlora-nf4") measured in a fresh process from `adapter`, with the
    planner's buckets for MiniGPT and LLaMA-7B beside them (Lab 03's block D)."""
    rows = {name: measure_in_fresh_process(Setup(name, str(base), str(adapter), lora.to_dict(), data,
                                                 memory.batch_size, memory.seq_len, steps, train.seed, train.lr))
            for name in names}
    fp32 = build_for_training(load_base(base)[0], "lora", lora, device="cpu")
    shape, regimes = minigpt_shape(fp32.config), [Regime("lora", lora.r), Regime("qlora", lora.r)]
    mini = plan(shape, regimes, lora.target_modules, memory)
    big = plan(preset_shape("llama-7b"), regimes, lora.target_modules, memory)
    return {"rows": rows, "steps": steps, "batch": [memory.batch_size, memory.seq_len],
            "lora_params": lora_trainable_params(shape, lora.r), "lora_tensors": 2 * len(lora_modules(fp32)),
            "fp32_lora_weights": account(fp32)["weights"],
            "planner": {"lora-fp16": mini.regimes[0].bytes.to_dict(), "qlora-nf4": mini.regimes[1].bytes.to_dict()},
            "planner_7b": {"lora-fp16": big.regimes[0].bytes.to_dict(), "qlora-nf4": big.regimes[1].bytes.to_dict(),
                           "params": big.total_params}}

"""What a lab records about a run besides its numbers: paths as the repository names them, how the base was
pretrained (from its manifest.json), text sampled from a model, and a run's speed and its rerun in another
precision (bf16 beside fp32)."""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.base_folder import MANIFEST
from minigpt.bf16_support import bf16_support
from minigpt.io import read_json
from minigpt.train import METRICS, loss_summary

from .base_model import Tokenizer
from .finetune import FinetuneConfig, finetune


def display_path(path: Path, root: Path) -> str:
    """`path` relative to `root` when it lies inside it (so a report reads the same on every machine)."""
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def base_pretrain(base: Path) -> dict | None:
    """How the base was pretrained (steps, data, final val loss), from its manifest.json; None without one."""
    if not (Path(base) / MANIFEST).is_file():
        return None
    m = read_json(Path(base) / MANIFEST)
    return {"steps": m["config"]["train"]["steps"], "data": m["config"]["data"],
            "val_loss": m.get("results", {}).get("final_val_loss")}


def sample_texts(model: nn.Module, tokenizer: Tokenizer, prompts: tuple[str, ...], n_tokens: int = 120,
                 temperature: float = 0.8, seed: int = 0) -> list[str]:
    """One continuation per prompt, drawn from one seeded generator in prompt order."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([tokenizer.encode(p)]), n_tokens, temperature=temperature, generator=gen)
        out.append(tokenizer.decode(ids[0].tolist()))
    return out


def run_speed(out: Path) -> dict:
    """Median step time (s) and tokens/s from a run's metrics.jsonl (the first step, which warms up, left out)."""
    rows = [json.loads(line) for line in (Path(out) / METRICS).read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows[1:] or rows if "step_time_s" in r]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows)}


def precision_run(base: Path, cfg: FinetuneConfig, precision: str, out: Path, progress: bool = True) -> dict:
    """The fine-tune `cfg` again in `precision`, written to `out`: its val loss, loss curve summary, speed and
    the device's bf16 support (bf16 runs even where slow: a lab's figures say so instead of refusing)."""
    cfg = replace(cfg, train=replace(cfg.train, precision=precision))
    res = finetune(base, out, cfg, progress=progress, overwrite=True, allow_slow_bf16=True)
    rows = [json.loads(line) for line in (Path(out) / METRICS).read_text(encoding="utf-8").splitlines()]
    s = loss_summary(rows)
    return {"precision": precision, "val_loss_after": res.summary["val_loss_after"],
            "wall_time_s": res.summary["train_wall_time_s"], "bf16_support": bf16_support("cpu").to_dict(),
            **{k: s[k] for k in ("steps", "all_finite", "first_loss", "last_loss", "first_mean", "last_mean")},
            **run_speed(out)}


def run_summary(out: Path, summary: dict, window: int = 10) -> dict:
    """A finished fine-tune's figures for a lab: its loss curve summarised over `window` steps (metrics.jsonl),
    train tokens, final val loss, wall time, speed and its manifest (`summary`: FinetuneResult.summary)."""
    rows = [json.loads(line) for line in (Path(out) / METRICS).read_text(encoding="utf-8").splitlines()]
    s = loss_summary(rows, window)
    return {"speed": run_speed(out), "steps": s["steps"], "train_tokens": summary["train_tokens"],
            **{k: s[k] for k in ("all_finite", "first_loss", "last_loss", "first_mean", "last_mean", "mean_window", "val")},
            "val_loss_after": summary["val_loss_after"], "wall_time_s": summary["train_wall_time_s"],
            "finetune_manifest": read_json(Path(out) / MANIFEST)}

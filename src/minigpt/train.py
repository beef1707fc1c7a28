"""One training loop for pretraining, full fine-tuning, LoRA and QLoRA.

AdamW over the parameters that require grad (nothing else gets optimizer state), warmup then cosine
or constant LR, gradient clipping, evaluation every N steps, a progress bar, metrics.jsonl and a
loss-curve PNG.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from .data import eval_batches, sample_batch
from .errors import InputError


@dataclass
class TrainConfig:
    steps: int = 1500  # optimizer steps
    batch_size: int = 32  # sequences per step
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50  # linear warmup from 0
    schedule: str = "cosine"  # "cosine" or "constant" (after warmup)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 250  # evaluate on val every N steps (and at the end)
    eval_batches: int = 16  # batches per evaluation
    seed: int = 1337

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise InputError("steps and batch_size must be >= 1")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise InputError(f"lr must be a positive number, got {self.lr}")
        if self.schedule not in ("cosine", "constant"):
            raise InputError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, block_size: int, batch_size: int = 32, max_batches: int = 16) -> float:
    """Mean next-token loss (nats) over fixed windows of a split."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for x, y in eval_batches(data, batch_size, block_size, max_batches):
        total += lm_loss(model, x.to(device), y.to(device)).item() * x.size(0)
        n += x.size(0)
    model.train(was_training)
    return total / n


@dataclass
class TrainResult:
    steps: int
    final_train_loss: float
    final_val_loss: float
    wall_time_s: float
    history: list[dict] = field(default_factory=list)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(
    model: nn.Module,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    cfg: TrainConfig,
    out_dir: Path | None = None,
    block_size: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train the parameters of `model` that require grad; write metrics.jsonl and loss_curve.png to out_dir."""
    cfg.validate()
    block_size = block_size or model.config.block_size
    params = trainable_parameters(model)
    if not params:
        raise InputError("the model has no trainable parameters")
    device = params[0].device
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    metrics = open(out_dir / "metrics.jsonl", "w") if out_dir else None
    start = time.perf_counter()
    model.train()
    loss_val = float("nan")
    bar = tqdm(range(cfg.steps), disable=not progress, desc="train", dynamic_ncols=True)
    try:
        for step in bar:
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = sample_batch(train_ids, cfg.batch_size, block_size, gen)
            loss = lm_loss(model, x.to(device), y.to(device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at step {step + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            row = {"step": step + 1, "lr": lr, "train_loss": loss.item()}
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                loss_val = evaluate(model, val_ids, block_size, cfg.batch_size, cfg.eval_batches)
                row["val_loss"] = loss_val
                bar.set_postfix(train=f"{row['train_loss']:.3f}", val=f"{loss_val:.3f}")
            history.append(row)
            if metrics:
                metrics.write(json.dumps(row) + "\n")
    finally:
        if metrics:
            metrics.close()
    result = TrainResult(cfg.steps, history[-1]["train_loss"], loss_val, time.perf_counter() - start, history)
    if out_dir:
        plot_loss_curve(history, out_dir / "loss_curve.png")
    return result


def plot_loss_curve(history: list[dict], path: Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    train = [r["train_loss"] for r in history]
    k = max(1, len(train) // 50)  # moving average so the trend is readable
    smooth = [sum(train[max(0, i - k + 1) : i + 1]) / len(train[max(0, i - k + 1) : i + 1]) for i in range(len(train))]
    evals = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, train, alpha=0.25, color="tab:blue", label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", label=f"train ({k}-step mean)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)


def config_dict(cfg) -> dict:
    return asdict(cfg)

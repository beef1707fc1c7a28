"""One training loop for pretraining, full fine-tuning, LoRA and QLoRA (and its step, which memory checks reuse).

AdamW over the parameters that require grad (nothing else gets optimizer state), warmup then cosine
or constant LR, gradient clipping, evaluation every N steps, a progress bar (tokens/s), metrics.jsonl
(one row per step: lr, train loss, ``step_time_s`` and ``tokens_per_s``, val loss when evaluated) and a
loss-curve PNG. With an output folder it writes resumable checkpoints (minigpt.train_state) and
``resume=True`` continues from the newest one, bit-identically on CPU. A non-finite loss or gradient
stops the run naming the step (or, with ``skip_nonfinite``, skips that step).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from .cross_entropy import IGNORE_INDEX, cross_entropy
from .train_state import (CHECKPOINT_DIR, TrainState, capture_rng, check_compatible, clear_checkpoints,
                            latest_checkpoint, list_checkpoints, restore, save_checkpoint)
from .data import eval_batches, sample_batch
from .device import PRECISIONS
from .distributed import barrier, check_batch, is_writer, mean_across_ranks, shard, world_size, wrap_ddp
from .errors import InputError
from .io import atomic_write_text, sha256_file


@dataclass
class TrainConfig:
    steps: int = 1500  # optimizer steps
    batch_size: int = 32  # sequences per forward and backward (a micro-batch; the global one under torchrun)
    grad_accum: int = 1  # micro-batches whose gradients add up to one optimizer step (gradient accumulation)
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50  # linear warmup from 0
    schedule: str = "cosine"  # "cosine" or "constant" (after warmup)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 250  # evaluate on val every N steps (and at the end)
    eval_batches: int = 16  # batches per evaluation
    seed: int = 1337
    checkpoint_every: int = 0  # write a resumable checkpoint every N steps and at the end (needs out_dir); 0: none
    keep_checkpoints: int = 2  # how many of the newest checkpoints stay on disk
    skip_nonfinite: bool = False  # skip a step whose loss or gradients are NaN/inf instead of stopping the run
    precision: str = "fp32"  # "fp32" or "bf16" (a model built for bf16 compute: minituner.build, precision="bf16")
    grad_checkpoint: bool = False  # recompute each block in backward (model.grad_checkpoint): less memory, same result

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise InputError("steps, batch_size and grad_accum must be >= 1")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise InputError("checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise InputError(f"lr must be a positive number, got {self.lr}")
        if self.schedule not in ("cosine", "constant"):
            raise InputError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def counted_logits(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits a next-token loss reads and their targets: (B, T, V) and y when every target counts; else
    only the positions whose target counts, (n, V) and (n,), the model's head run on those rows alone
    (``forward(idx, keep=mask)``, ``minigpt.model.head_rows``). The loss and its gradient are the same: a
    target that does not count adds nothing to either."""
    counts = y != IGNORE_INDEX
    if bool(counts.all()):
        return model(x), y
    return model(x, keep=counts), y[counts]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the targets of y that count (y = -100, cross_entropy's ignore_index, does not)."""
    # logits in the head's dtype, the loss in fp32; no one sees the logits: their gradient is written over them
    return cross_entropy(*counted_logits(model, x, y), overwrite_logits=True)


def counted_loss(counted: int, ranks: int) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss_fn for one rank's shard of one micro-batch of a step whose micro-batches (all ranks' shards) count
    `counted` targets in all, over `ranks` processes.

    Each call returns (sum of its shard's token losses) / counted * ranks, so DDP's mean of the ranks' gradients,
    summed over the micro-batches, is the gradient of the step's mean loss even when shards and micro-batches
    count different numbers of tokens (masked labels, padding): lm_loss on each would weigh a short one's tokens
    more (the gradient-accumulation loss that transformers fixed in 4.46 by passing num_items_in_batch).
    """

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = cross_entropy(*counted_logits(model, x, y), reduction="sum", overwrite_logits=True)
        return total * (ranks / counted)

    return loss_fn


# an evaluation forward holds at most about this much of fp32 logits at once (and as much again in the loss's
# log-softmax; one row when a row is larger): evaluating full windows, every target counting, would otherwise hold
# (B·T, V) twice while training on an instruction set counts few targets (Llama 3's vocabulary at 32 x 512 tokens:
# 16 GiB). Evaluation keeps no activations; the planner (minituner.planner) plans training steps only.
EVAL_LOGITS_BYTES = 256 << 20


def eval_rows(x: torch.Tensor, y: torch.Tensor, vocab_size: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An evaluation batch (B, T) as a few rows at a time, so that one forward's fp32 logits (rows x T x V) stay
    under EVAL_LOGITS_BYTES (at least one row each); whole when it fits or the vocabulary is unknown."""
    per_row = x.size(1) * (vocab_size or 0) * 4
    rows = max(1, EVAL_LOGITS_BYTES // per_row) if per_row else x.size(0)
    return [(x[i : i + rows], y[i : i + rows]) for i in range(0, x.size(0), rows)]


def vocab_size_of(model: nn.Module) -> int | None:
    """The model's vocabulary (its config's vocab_size), or None for a module without one."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, block_size: int, batch_size: int = 32, max_batches: int = 16) -> float:
    """Mean next-token loss (nats) over fixed windows of a split (every window counts all its block_size targets)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for batch in eval_batches(data, batch_size, block_size, max_batches):
        for x, y in eval_rows(*batch, vocab_size_of(model)):
            total += lm_loss(model, x.to(device), y.to(device)).item() * x.size(0)
            n += x.size(0)
    model.train(was_training)
    return total / n


RESUME_FREE = ("checkpoint_every", "keep_checkpoints", "skip_nonfinite", "grad_checkpoint")  # may change on resume
METRICS = "metrics.jsonl"
TIMING_FIELDS = ("step_time_s", "tokens_per_s")  # metrics.jsonl's wall-clock fields: they differ between runs


def step_timing(seconds: float, tokens: int) -> dict[str, float]:
    """A metrics row's timing: the optimizer step's wall time (batch, forward, backward, update) and tokens/s."""
    return {"step_time_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def without_timing(rows: list[dict]) -> list[dict]:
    """Metrics rows less their wall-clock fields: what a resumed run reproduces bit for bit."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient stopped the run; the CLI prints it as one line and exits with code 2."""


@dataclass
class TrainResult:
    steps: int
    final_train_loss: float
    final_val_loss: float
    wall_time_s: float  # summed over the run and its resumes
    history: list[dict] = field(default_factory=list)
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient (skip_nonfinite)
    resumes: list[dict] = field(default_factory=list)  # one per resume: step, checkpoint, sha256


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def run_identity(cfg: TrainConfig, train_ids: torch.Tensor | None, val_ids: torch.Tensor | None,
                 fingerprint: dict | None, data_identity: dict | None = None) -> dict:
    """What a checkpoint must share with the run that resumes it: the config (checkpoint options aside),
    the data (the sha256 of train_ids and val_ids, or the caller's `data_identity`, e.g. the sha256 of
    tokenized examples) and the caller's fingerprint of the model (e.g. the base's sha256)."""
    # grad_accum joins only where it accumulates: checkpoints of runs from before it resume
    config = {k: v for k, v in asdict(cfg).items() if k not in RESUME_FREE and (k, v) != ("grad_accum", 1)}
    data = data_identity if data_identity is not None else {
        "train_ids_sha256": tensor_sha256(train_ids), "val_ids_sha256": tensor_sha256(val_ids)}
    return {"config": config, "fingerprint": {**(fingerprint or {}), **data}}


def resumed_progress(state, path: Path, steps: int) -> tuple[int, float, int, float, list]:
    """(step, elapsed seconds, skipped steps, last val loss, resumes) of a checkpoint, each checked: a damaged
    one is an InputError naming it, never a traceback or a run resumed from a step it cannot hold."""
    info = state.info
    try:
        step, elapsed, skipped = int(state.step), float(info["elapsed_s"]), int(info["skipped_steps"])
        val = float("nan") if info["val_loss"] is None else float(info["val_loss"])
        resumes = list(info["resumes"])
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: damaged checkpoint info ({type(e).__name__}: {e}); --overwrite starts over") \
            from None
    if not 1 <= step <= steps:
        raise InputError(f"{path}: records step {step}, outside this run's 1..{steps} (a damaged checkpoint); "
                         "--overwrite starts over")
    return step, elapsed, skipped, val, resumes


def read_metrics(path: Path, upto: int) -> list[dict]:
    """The rows of metrics.jsonl for steps 1..upto; a row cut short by a kill, and every later row, is dropped."""
    rows: list[dict] = []
    if not path.is_file():
        return rows
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text (damaged); --overwrite starts over") from None
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > upto:
            break
        rows.append(row)
    return rows


def grad_norm(params: list[nn.Parameter], clip: float) -> torch.Tensor:
    """Global L2 norm of the gradients; with clip > 0 they are clipped to it (torch's clip_grad_norm_)."""
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where PyTorch has a fused AdamW kernel (torch.optim.AdamW(fused=True))


def adamw(params: list[nn.Parameter], lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The optimizer of every training loop here: AdamW with betas (0.9, 0.95), fused on CPU and CUDA.

    Fused: PyTorch's one kernel per group of tensors that reads each parameter, gradient and moment once and
    allocates nothing. The default off CUDA is the single-tensor loop, a dozen ops per parameter with two
    temporaries of its size (``exp_avg_sq.sqrt()`` and its division). For the 96 LoRA factors of
    benchmarks/bench_bf16.py's GPT-shaped QLoRA step: 1.12 ms against the loop's 3.29 (medians of 20 steps, the
    two alternating in one process; AMD EPYC, 2 cores, 2026-12-03). Its updates agree with the loop's to about
    one unit in the last place of fp32 (tests/minigpt/test_adamw.py)."""
    params = list(params)
    fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused or None)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, params: list[nn.Parameter],
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], clip: float, loss_fn: Callable | None = None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               forward_context: contextlib.AbstractContextManager | None = None,
               on_phase: Callable[[str], None] | None = None) -> tuple[torch.Tensor, str | None]:
    """One optimizer step of the loop: forward and backward of each micro-batch (x, y), the gradients adding up,
    then clip, finite check and update (bf16 compute lives in the modules).

    With one micro-batch the loss is `loss_fn` (default lm_loss); with more, `loss_fn` must weigh each so that
    their losses sum to the step's (``counted_loss``). Returns the loss every rank reports (each micro-batch's
    `reduce`d, default the local loss, detached, summed) and what was not finite (None for a good step; otherwise
    the weights are not updated). Under DDP the gradients are synchronised once, in the last micro-batch's
    backward (``no_sync`` before). `forward_context` wraps each forward (e.g. to watch saved tensors);
    `on_phase(name)` is called at the end of each phase of each micro-batch: "forward" (its loss exists),
    "backward" (its gradients are added; after the last, clipped and final, before the update) and "optimizer
    step" (a good step only). The last step's gradients are set to None after the first forward.
    """
    if len(micro_batches) > 1 and loss_fn is None:
        raise ValueError("accumulating micro-batches needs a loss_fn whose losses sum to the step's (counted_loss)")
    phase = on_phase or (lambda name: None)
    device = params[0].device
    reported, problem = None, None
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with forward_context or contextlib.nullcontext():
            loss = (loss_fn or lm_loss)(model, x.to(device), y.to(device))
        mine = loss.detach() if reduce is None else reduce(loss.detach())
        reported = mine if reported is None else reported + mine
        phase("forward")
        if i == 0:
            opt.zero_grad(set_to_none=True)
        if not torch.isfinite(mine):
            problem = f"non-finite loss ({mine.item()})"
            break
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            loss.backward()
        del loss  # the graph is freed by backward; the tensor itself is not needed past this point
        if last:
            norm = grad_norm(params, clip)
            if not torch.isfinite(norm):
                problem = f"non-finite gradients (norm {norm.item()})"
        phase("backward")
    if problem is None:
        opt.step()
        phase("optimizer step")
    return reported, problem


def last_good_checkpoint(ckpt_dir: Path | None, every: int) -> str:
    found = list_checkpoints(ckpt_dir) if ckpt_dir and every else []
    if not found:
        why = "yet" if every else "(checkpoint_every is 0)"
        return f"no checkpoint was written {why}; --skip-nonfinite skips such steps"
    step, path = found[-1]
    return (f"the last good checkpoint is {CHECKPOINT_DIR}/{path.name} (step {step}): --resume continues from it, "
            "--skip-nonfinite skips such steps")


def train(
    model: nn.Module,
    train_ids: torch.Tensor | None,
    val_ids: torch.Tensor | None,
    cfg: TrainConfig,
    out_dir: Path | None = None,
    block_size: int | None = None,
    progress: bool = True,
    resume: bool = False,
    fingerprint: dict | None = None,
    log=print,
    batches: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None,
    val_loss: Callable[[nn.Module], float] | None = None,
    data_identity: dict | None = None,
) -> TrainResult:
    """Train the parameters of `model` that require grad; write metrics, loss curve and checkpoints to out_dir.

    The data is random windows of train_ids (sample_batch) evaluated on fixed windows of val_ids, or, for
    other data (e.g. padded instruction examples), `batches(batch_size, generator) -> (x, y)` (the global
    batch; y = -100 where a target does not count), `val_loss(model) -> float` and `data_identity` (what
    identifies the data in checkpoints), which replace train_ids and val_ids (then None). Each step draws
    cfg.grad_accum such batches and adds up their gradients, every counted target weighing the same.
    resume=True continues from the newest checkpoint in out_dir/checkpoints, which must come from a run with
    the same config (checkpoint options aside), data and `fingerprint`; otherwise old checkpoints are removed.
    Under torchrun (minigpt.distributed) each rank trains on its shard of the global batch and rank 0 writes.
    """
    cfg.validate()
    if (train_ids is None and (batches is None or data_identity is None)) or (val_ids is None and val_loss is None):
        raise ValueError("train() needs train_ids and val_ids, or batches, val_loss and data_identity in their place")
    check_batch(cfg.batch_size)
    writer = is_writer()
    block_size = block_size or model.config.block_size
    named = named_trainable_parameters(model)
    params = [p for _, p in named]
    if not params:
        raise InputError("the model has no trainable parameters")
    if (resume or cfg.checkpoint_every) and out_dir is None:
        raise InputError("checkpoints and resume need an output folder")
    device = params[0].device
    if cfg.precision == "bf16" and not any(t.dtype == torch.bfloat16 for t in (*model.parameters(), *model.buffers())):
        raise InputError("precision bf16 needs a model built for bf16 compute "
                         "(minituner.build.build_for_training(..., precision='bf16'))")
    opt = adamw(params, cfg.lr, cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    identity = run_identity(cfg, train_ids, val_ids, fingerprint, data_identity)
    draw = batches or (lambda n, g: sample_batch(train_ids, n, block_size, g))
    validate = val_loss or (lambda m: evaluate(m, val_ids, block_size, cfg.batch_size, cfg.eval_batches))
    ranks = world_size()
    ckpt_dir = Path(out_dir) / CHECKPOINT_DIR if out_dir else None
    history: list[dict] = []
    first, elapsed, skipped, resumes, loss_val = 0, 0.0, 0, [], float("nan")
    if resume:
        found = latest_checkpoint(ckpt_dir, log)
        if found is None:  # (check_run_dir found one: each was damaged, as the warnings said)
            raise InputError(f"{ckpt_dir}: no checkpoint to resume from (every one is damaged); --overwrite starts "
                             "over")
        state, path = found
        check_compatible(state.info, identity, path)
        restore(state, named, opt, gen, path)
        first, elapsed, skipped, loss_val, resumes = resumed_progress(state, path, cfg.steps)
        resumes = resumes + [{"step": first, "checkpoint": f"{CHECKPOINT_DIR}/{path.name}",
                              "sha256": sha256_file(path)}]
        history = read_metrics(Path(out_dir) / METRICS, first)
        log(f"resuming from {CHECKPOINT_DIR}/{path.name}: step {first} of {cfg.steps}")
    elif ckpt_dir is not None and writer:
        clear_checkpoints(ckpt_dir)
    barrier()  # every rank has read its checkpoint before rank 0 may write (and prune) the next one
    if hasattr(model, "grad_checkpoint"):
        model.grad_checkpoint = cfg.grad_checkpoint
    step_model = wrap_ddp(model, device)  # the model itself in a single process
    metrics = None
    if out_dir and writer:
        atomic_write_text(Path(out_dir) / METRICS, "".join(json.dumps(r) + "\n" for r in history))
        metrics = open(Path(out_dir) / METRICS, "a", encoding="utf-8")
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(first, cfg.steps), initial=first, total=cfg.steps, disable=not (progress and writer), desc="train",
               dynamic_ncols=True)
    postfix: dict[str, str] = {}  # tokens/s of the last step, train and val loss of the last evaluation
    try:
        for step in bar:
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            tic = time.perf_counter()
            micro = [draw(cfg.batch_size, gen) for _ in range(cfg.grad_accum)]  # global batches, alike on every rank
            tokens = sum(x.numel() for x, _ in micro)  # the step's, every rank's
            loss_fn = None  # lm_loss; else weigh every target by the step's counted targets (all ranks, micro-batches)
            if cfg.grad_accum > 1 or (batches is not None and ranks > 1):
                loss_fn = counted_loss(max(1, sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)), ranks)
            micro = [shard(x, y) for x, y in micro]  # this rank's rows
            reported, problem = train_step(step_model, opt, params, micro, cfg.grad_clip, loss_fn,
                                           reduce=mean_across_ranks)  # reported: the step's loss
            loss_now = reported.item()  # waits for the device: the step is done
            timing = step_timing(time.perf_counter() - tic, tokens)
            if problem is None:
                row = {"step": step + 1, "lr": lr, "train_loss": loss_now, **timing}
            elif cfg.skip_nonfinite:
                opt.zero_grad(set_to_none=True)  # the weights and optimizer state stay as they were
                skipped += 1
                row = {"step": step + 1, "lr": lr, "train_loss": None, "skipped": problem, **timing}
            else:
                raise NonFiniteError(f"{problem} at step {step + 1}; the run stopped before updating the weights; "
                                     + last_good_checkpoint(ckpt_dir, cfg.checkpoint_every))
            postfix["tok/s"] = f"{timing['tokens_per_s']:,.0f}"
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                loss_val = validate(model)
                row["val_loss"] = loss_val
                postfix.update(train=f"{loss_now:.3f}", val=f"{loss_val:.3f}")
            bar.set_postfix(postfix, refresh=False)
            history.append(row)
            if metrics:
                metrics.write(json.dumps(row) + "\n")
            if writer and cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                metrics.flush()
                os.fsync(metrics.fileno())  # every row up to the checkpoint is on disk before it is
                info = {**identity, "val_loss": loss_val if math.isfinite(loss_val) else None, "skipped_steps": skipped,
                        "elapsed_s": elapsed + time.perf_counter() - start, "resumes": resumes}
                save_checkpoint(ckpt_dir, TrainState(step + 1, dict(named), opt.state_dict(), capture_rng(gen), info),
                                cfg.keep_checkpoints)
    finally:
        if metrics:
            metrics.close()
    losses = [r["train_loss"] for r in history if r.get("train_loss") is not None]
    result = TrainResult(cfg.steps, losses[-1] if losses else float("nan"), loss_val,
                         elapsed + time.perf_counter() - start, history, skipped, resumes)
    if out_dir and writer:
        plot_loss_curve(history, Path(out_dir) / "loss_curve.png")
    return result


def loss_summary(history: list[dict], window: int = 10) -> dict:
    """A run's metrics rows in a few numbers: first/last train loss, the means of the first and last `window`
    steps, whether every logged loss is finite, and the validation points as (step, loss)."""
    losses = [r["train_loss"] for r in history if r.get("train_loss") is not None]
    return {"steps": len(history), "all_finite": all(math.isfinite(v) for v in losses),
            "first_loss": losses[0], "last_loss": losses[-1], "first_mean": sum(losses[:window]) / window,
            "last_mean": sum(losses[-window:]) / window, "mean_window": window,
            "val": [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]}


def plot_loss_curve(history: list[dict], path: Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history if r.get("train_loss") is not None]  # skipped (non-finite) steps have none
    steps = [r["step"] for r in rows]
    train = [r["train_loss"] for r in rows]
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

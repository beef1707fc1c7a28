"""Check the planner against a real run: build the model, train a few steps, measure each memory bucket.

Measured, bucket by bucket (bytes; every storage counted once, so tied weights and views count once):
- weights, grads, optimizer: ``accounting.account`` (parameters and buffers, QLoRA's NF4 codes and
  absmax included; every ``.grad`` after backward; Adam's state after a step), with Adam's 0-d ``step``
  counters shown apart (4 bytes per trainable tensor; the planner's optimizer bucket is m and v);
- activations: every tensor the forward saves for backward, seen by ``torch.autograd.graph.saved_tensors_hooks``,
  minus the storages of parameters and buffers (a Linear saves its weight: that is the weights bucket);
- peak: the process's memory high-water mark during the training steps, above what it held before the
  model was built. On CPU the resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``); on CUDA
  ``torch.cuda.max_memory_allocated``. The planner has no peak model: its buckets' total is shown
  beside it, and the gap is what a step holds transiently (logit gradients, allocator slack, libraries).

The prediction is ``planner.regime_bytes`` told the run's dtypes (fp32 weights, grads and Adam; fp32
activations, or bf16 under autocast, which the exact model does not cover) with the exact activation
model of ``planner/activations.py``; the seed's and Korthikanti's activation estimates are shown with
their own errors.
"""
from __future__ import annotations

import math
import resource
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.device import autocast, check_precision
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import adamw, lm_loss, train_step

from ..build import build_for_training
from ..lora import ALL_LINEAR, LoRAConfig
from .accounting import account, storage_bytes
from ..planner import (MemoryConfig, Regime, korthikanti_activation_bytes, minigpt_shape, regime_bytes,
                      seed_activation_bytes)
from ..planner.report import UNITS
from ..qlora import param_summary

REGIMES = ("full", "lora", "qlora")
BUCKETS = ("weights", "grads", "optimizer", "activations")


@dataclass(frozen=True)
class CheckConfig:
    regime: str = "lora"  # "full", "lora" or "qlora"
    rank: int = 8  # LoRA rank (lora, qlora)
    alpha: float = 16.0  # lora_alpha: changes no byte
    targets: str = ALL_LINEAR  # LoRA targets (and, for qlora, the Linears stored in NF4)
    batch_size: int = 4
    seq_len: int = 64
    steps: int = 2  # training steps; Adam's state exists from the first one
    seed: int = 0
    precision: str = "fp32"  # "fp32" or "bf16-autocast" (CUDA)

    def validate(self, block_size: int) -> None:
        if self.regime not in REGIMES:
            raise InputError(f"regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        for name in ("batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len > block_size:
            raise InputError(f"seq_len {self.seq_len} exceeds the model's block_size {block_size}")


def disable_dropout(model: nn.Module) -> None:
    """Dropout 0 everywhere (the exact activation model covers the dropout-free forward)."""
    model.config.dropout = 0.0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if hasattr(m, "dropout") and isinstance(m.dropout, float):  # attention's dropout_p
            m.dropout = 0.0


def prepare(model: MiniGPT, check: CheckConfig, device: torch.device) -> None:
    """Make the model trainable the way the regime trains it (QLoRA: NF4 targets, fp32 float parts)."""
    build_for_training(model, check.regime, LoRAConfig(r=check.rank, alpha=check.alpha, target_modules=check.targets),
                       device=device, compute_dtype=torch.float32)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """accounting.account's buckets, with Adam's 0-d step counters taken out of the optimizer bucket."""
    acc = account(model, optimizer)
    steps = storage_bytes([state["step"] for state in optimizer.state.values() if torch.is_tensor(state.get("step"))])
    return {"weights": acc["weights"], "grads": acc["grads"], "optimizer": acc["optimizer"] - steps,
            "optimizer_steps": steps}


class _Packed:
    """What the pack hook hands autograd: the tensor's data (no copy), weakly trackable."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        # detached: a saved output would otherwise hold its own grad_fn (a cycle autograd never frees)
        self.tensor = tensor.detach()


class SavedTensors:
    """Context manager: bytes of the distinct storages autograd holds for backward when the block ends.

    Tensors saved by graph pieces that were dropped inside the block (e.g. a check like
    ``torch.isfinite(out)`` on a tensor that needs grad) are freed with them and not counted; parameter
    and buffer storages are the weights bucket and not counted either.
    """

    def __init__(self, model: nn.Module) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.live: weakref.WeakSet[_Packed] = weakref.WeakSet()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed.tensor)

    def _pack(self, t: torch.Tensor) -> _Packed:
        packed = _Packed(t)
        self.live.add(packed)
        return packed

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        storages = {}
        for packed in list(self.live):
            s = packed.tensor.untyped_storage()
            if s.data_ptr() not in self.exclude:
                storages[s.data_ptr()] = s.nbytes()
        self.bytes = sum(storages.values())


class PeakMemory:
    """High-water mark of the process (CPU: resident set) or of the CUDA allocator, above a baseline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = ""

    def start(self) -> None:
        """Record the baseline (before the model exists)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _rss_bytes("VmRSS") or 0

    def reset_peak(self) -> None:
        """Start the high-water mark afresh (after building the model: its build-time temporaries do not count)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.source = "torch.cuda.max_memory_allocated during training"
            return
        try:  # Linux: writing 5 resets VmHWM to the current resident set
            Path("/proc/self/clear_refs").write_text("5")
            self.source = "resident set high-water mark (VmHWM) during training"
        except OSError:
            self.source = "ru_maxrss since process start (VmHWM could not be reset)"

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        hwm = _rss_bytes("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return hwm - self.base


def _rss_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


@dataclass
class CheckResult:
    name: str
    check: CheckConfig
    device: str
    predicted: dict[str, int]  # the planner's buckets + "total"
    measured: dict[str, int]  # buckets + "optimizer_steps" + "peak"
    estimates: dict[str, int]  # other activation estimates: "seed", "korthikanti"
    peak_source: str
    trainable_params: int
    params: int  # the base's parameters by element (a quantized weight too), as the planner counts them
    activation_note: str = "exact model (planner/activations.py)"
    losses: list[float] = field(default_factory=list)

    def error(self, predicted: int, measured: int) -> float:
        """Relative error of a prediction, in percent of the measurement."""
        return 100.0 * (predicted - measured) / measured if measured else (0.0 if predicted == 0 else math.inf)

    def rows(self) -> list[tuple[str, int, int, float]]:
        """(bucket, predicted bytes, measured bytes, error %) for the table."""
        out = [(b, self.predicted[b], self.measured[b], self.error(self.predicted[b], self.measured[b])) for b in BUCKETS]
        act = self.measured["activations"]
        out += [(f"activations, {k} estimate", v, act, self.error(v, act)) for k, v in self.estimates.items()]
        out.append(("peak (planner total)", self.predicted["total"], self.measured["peak"],
                    self.error(self.predicted["total"], self.measured["peak"])))
        return out

    def to_dict(self) -> dict:
        return {"model": self.name, "device": self.device, "regime": self.check.regime,
                "rank": None if self.check.regime == "full" else self.check.rank, "targets": self.check.targets,
                "batch_size": self.check.batch_size, "seq_len": self.check.seq_len, "precision": self.check.precision,
                "params": self.params, "trainable_params": self.trainable_params,
                "rows": [{"bucket": b, "predicted_bytes": p, "measured_bytes": m, "error_percent": e}
                         for b, p, m, e in self.rows()],
                "optimizer_step_counter_bytes": self.measured["optimizer_steps"], "peak_source": self.peak_source}


def predict(cfg: GPTConfig, check: CheckConfig, name: str = "model") -> tuple[dict[str, int], dict[str, int]]:
    """The planner's buckets for this run (fp32 weights, grads, Adam; exact activations) and the two estimates."""
    shape = minigpt_shape(cfg, name)
    regime = Regime("full") if check.regime == "full" else Regime(check.regime, check.rank)
    dtype = "bf16" if check.precision == "bf16-autocast" else "fp32"
    mem = MemoryConfig(batch_size=check.batch_size, seq_len=check.seq_len, full_precision="fp32",
                       activations="exact", dtype="fp32")
    b = regime_bytes(shape, regime, check.targets, mem)
    act = regime_bytes(shape, regime, check.targets, MemoryConfig(
        batch_size=check.batch_size, seq_len=check.seq_len, activations="exact", dtype=dtype)).activations
    predicted = {"weights": b.weights, "grads": b.grads, "optimizer": b.optimizer, "activations": act}
    predicted["total"] = sum(predicted.values())
    estimates = {"seed": seed_activation_bytes(shape, check.batch_size, check.seq_len),
                 "korthikanti": korthikanti_activation_bytes(shape, check.batch_size, check.seq_len)}
    return predicted, estimates


def warm_up(device: torch.device) -> None:
    """One step of a tiny model, so that the libraries' one-time buffers are not counted in the peak."""
    model = MiniGPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, d_model=8)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.zeros(1, 5, dtype=torch.long, device=device)
    lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
    opt.step()


def memory_check(build: Callable[[], MiniGPT], check: CheckConfig, device: torch.device,
                 name: str = "model") -> CheckResult:
    """Build the model with `build` (on `device`), train check.steps steps on random tokens, measure, predict."""
    check_precision(check.precision, device)
    warm_up(device)
    meter = PeakMemory(device)
    meter.start()
    model = build()
    check.validate(model.config.block_size)
    disable_dropout(model)
    prepare(model, check, device)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InputError("the model has no trainable parameters")
    opt = adamw(params, lr=1e-4)  # minigpt.train's optimizer, and its step below (clipping at 1.0)
    meter.reset_peak()
    gen = torch.Generator().manual_seed(check.seed)
    vocab, activations, losses, grads = model.config.vocab_size, 0, [], 0
    for step in range(check.steps):
        ids = torch.randint(vocab, (check.batch_size, check.seq_len + 1), generator=gen)
        x, y = ids[:, :-1].clone().to(device), ids[:, 1:].clone().to(device)  # (B, T) each, own storages
        saved = SavedTensors(model)

        def record_grads() -> None:
            nonlocal grads
            grads = state_bytes(model, opt)["grads"]

        loss, problem = train_step(model, opt, params, x, y, 1.0, check.precision, forward_context=saved,
                                   before_update=record_grads)
        if problem is not None:
            raise FloatingPointError(f"{problem} at step {step + 1}")
        activations = max(activations, saved.bytes)
        losses.append(loss.item())
    measured = {**state_bytes(model, opt), "grads": grads, "activations": activations, "peak": meter.peak()}
    predicted, estimates = predict(model.config, check, name)
    note = ("exact model (planner/activations.py)" if check.precision == "fp32"
            else "exact model's op structure at 2 bytes/element: an approximation under autocast")
    return CheckResult(name, check, str(device), predicted, measured, estimates, meter.source,
                       sum(p.numel() for p in params), base_params(model), note, losses)


def base_params(model: nn.Module) -> int:
    """The base's parameters by element (a quantized weight too, as the planner counts it), LoRA factors left out."""
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return param_summary(model).all - lora


def format_table(result: CheckResult, unit: str = "MiB") -> str:
    """Markdown: predicted vs measured per bucket, in `unit` (1024-based) and bytes, with the error."""
    u = UNITS[unit]
    lines = [f"| bucket | predicted {unit} | measured {unit} | predicted bytes | measured bytes | error |",
             "|---|---|---|---|---|---|"]
    for bucket, p, m, e in result.rows():
        err = f"{e:+.2f}%" if math.isfinite(e) else "n/a"
        lines.append(f"| {bucket} | {p / u:,.3f} | {m / u:,.3f} | {p:,} | {m:,} | {err} |")
    return "\n".join(lines)


def describe(result: CheckResult) -> str:
    c = result.check
    what = "full fine-tuning" if c.regime == "full" else f"{c.regime} r={c.rank} on {c.targets}"
    return (f"{result.name}: {result.params:,} base parameters (a quantized weight counted by element), "
            f"{result.trainable_params:,} trainable ({what}); "
            f"batch {c.batch_size} x seq {c.seq_len}, {c.steps} AdamW steps on {result.device} ({c.precision}).\n"
            f"Activations: {result.activation_note}. Adam step counters: {result.measured['optimizer_steps']:,} "
            f"bytes (not planned). Peak: {result.peak_source}, above the memory held before the model was built.")

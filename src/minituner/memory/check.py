"""Check the planner against a real run: build the model, train a few steps, measure each memory bucket.

Measured, bucket by bucket (bytes; every storage counted once, so tied weights and views count once):
- weights, grads, optimizer: ``accounting.account`` (parameters and buffers, QLoRA's NF4 codes and
  absmax included; every ``.grad`` after backward; Adam's state after a step), with Adam's 0-d ``step``
  counters shown apart (4 bytes per trainable tensor; the planner's optimizer bucket is m and v);
- activations: every tensor the forward saves for backward, seen by ``torch.autograd.graph.saved_tensors_hooks``,
  minus the storages of parameters and buffers (a Linear saves its weight: that is the weights bucket);
- peak: the memory high-water mark of the steady training steps (from the second on: Adam's state and
  the last step's grads exist), per phase (forward, backward, optimizer step), above the process's own
  memory. On CPU the resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` at each phase),
  with glibc's mmap threshold pinned at 16 KiB first (``pin_allocator``), so that a freed tensor goes back
  to the system as it does from CUDA's allocated bytes (by default glibc raises the threshold after the
  first frees and keeps them, and the resident set then holds freed activations of earlier steps); on
  CUDA ``torch.cuda.max_memory_allocated``. The process's own memory (Python, libraries' buffers,
  allocator slack) is measured before the measured steps as the resident set minus the live tensors'
  bytes (QLoRA's dequantization workspace and the logits a bf16 head keeps for the next step among them), shown
  as its own line ("baseline": its growth since
  before the model was built) and taken out of the peak, which the planner's peak model
  (``planner/peak.py``) predicts; the raw resident-set peak above the pre-build process is shown too.
  With the threshold pinned, the heap's free pages are handed back first (``malloc_trim``): the small blocks
  (under 16 KiB) that the first step freed inside the heap stay resident in varying amounts, and the next
  step's small blocks refill them unseen, so a baseline that counted them made the peak above it vary by
  about 0.4 MB from run to run, 10% of the smallest point of the bench's sweep (MiniGPT LoRA at 4 x 32
  tokens, a 3.6 MiB peak: errors from -8.1% to +9.9% in 16 runs on 1 and 2 threads, -8.1% to -3.6% in 10
  once trimmed; the larger points moved by under a point, 2026-12-04).

The prediction is ``planner.regime_bytes`` told the run's dtypes (fp32 weights, grads and Adam; under
--precision bf16 a bf16 frozen base beside fp32 norms and LoRA masters) with the exact activation model of
``planner/activations.py`` (MiniGPT, GPT-2) or ``planner/decoder_activations.py`` (llama, mistral, qwen2:
``minigpt.decoder.Decoder``) at the run's widths (``PRECISION_WIDTHS``: fp32 throughout, or bf16 compute's
bf16 block, fp32 stream and norms, and bf16 copies of the LoRA masters), and the step's peak of
``planner/peak.py`` at the same widths; the seed's and Korthikanti's activation estimates are shown with
their own errors.
"""
from __future__ import annotations

import math
import resource
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.decoder import DecoderConfig
from minigpt.device import check_precision
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT, block_list
from minigpt.train import IGNORE_INDEX, adamw, counted_loss, lm_loss, train_step
from miniquant.quantize import workspace_bytes

from ..base_model import load_base
from ..build import build_for_training, float_dtype
from ..dropout import config_dropout, set_model_dropout
from ..lora import ALL_LINEAR, LoRAConfig
from .accounting import account, storage_bytes
from .heap import pin_allocator, trim_heap
from .stored_dtypes import EMBEDDING_PARTS, dtype_of, stored_dtypes
from ..planner import (MemoryConfig, ModelShape, Regime, korthikanti_activation_bytes, minigpt_shape,
                       param_counts, regime_bytes, seed_activation_bytes)
from ..planner.activations import PRECISION_WIDTHS, check_dropout_range, counted_rows, dropout_phrase, lora_paths
from ..planner.decoder_activations import exact_activation_bytes
from ..planner.hf import decoder_shape
from ..planner.peak import step_peak
from ..planner.report import UNITS
from ..precision import LOW_BITS, kept_output_bytes
from ..qlora import param_summary

REGIMES = ("full", "lora", "qlora")
BUCKETS = ("weights", "grads", "optimizer", "activations")
JSON_BUCKETS = (*BUCKETS, "peak")  # the --json contract: predicted / measured / error over these
PHASES = ("forward", "backward", "optimizer step")  # where memory-check measures the high-water mark
# bytes: glibc serves larger blocks by mmap and gives them back when freed (at 64 KiB the (N, C) tensors of
# tiny runs stayed in the heap, where the resident set does not follow them, and read up to 20% off)
MMAP_THRESHOLD = 16 * 1024


@dataclass(frozen=True)
class CheckConfig:
    regime: str = "lora"  # "full", "lora" or "qlora"
    rank: int = 8  # LoRA rank (lora, qlora)
    alpha: float = 16.0  # lora_alpha: changes no byte
    targets: str = ALL_LINEAR  # LoRA targets (and, for qlora, the Linears stored in NF4)
    batch_size: int = 4
    seq_len: int = 64
    grad_accum: int = 1  # micro-batches of batch_size per step, their gradients adding up (gradient accumulation)
    steps: int = 2  # training steps; Adam's state exists from the first one
    seed: int = 0
    precision: str = "fp32"  # "fp32" or "bf16" (frozen base in bf16, LoRA masters fp32: minituner.precision)
    allow_slow_bf16: bool = False  # bf16 on a CPU without bf16 units (slower than fp32) instead of refusing
    grad_checkpoint: bool = False  # recompute each block in backward (model.grad_checkpoint)
    # positions per batch whose target counts (None: all); the others get -100, as an instruction batch's prompts
    counted_targets: int | None = None
    # the model's dropout in the check, replacing its config's (MiniGPT and GPT-2 only); None keeps the config's
    model_dropout: float | None = 0.0
    lora_dropout: float = 0.0  # dropout on the LoRA path's input (LoRAConfig.dropout)
    pin_allocator: bool = True  # CPU: pin glibc's mmap threshold so the resident set follows the live tensors

    def validate(self, block_size: int) -> None:
        if self.regime not in REGIMES:
            raise InputError(f"regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        for name in ("batch_size", "seq_len", "grad_accum", "steps"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len > block_size:
            raise InputError(f"seq_len {self.seq_len} exceeds the model's block_size {block_size}")
        counted_rows(self.batch_size * self.seq_len, self.counted_targets)  # 1 <= counted_targets <= batch x seq
        if self.model_dropout is not None:
            check_dropout_range(self.model_dropout, "the model's dropout")
        check_dropout_range(self.lora_dropout, "LoRA dropout")
        if self.regime == "full" and self.lora_dropout:
            raise InputError("LoRA dropout needs a LoRA regime (lora or qlora), not full fine-tuning")


def prepare(model: nn.Module, check: CheckConfig, device: torch.device) -> None:
    """Make the model trainable the way the regime trains it (QLoRA: NF4 targets; fp32 float parts, or bf16's)."""
    lora = LoRAConfig(r=check.rank, alpha=check.alpha, dropout=check.lora_dropout, target_modules=check.targets)
    build_for_training(model, check.regime, lora,
                       device=device, compute_dtype=torch.float32, precision=check.precision,
                       allow_slow_bf16=check.allow_slow_bf16)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """accounting.account's buckets, with Adam's 0-d step counters taken out of the optimizer bucket."""
    acc = account(model, optimizer)
    steps = storage_bytes([state["step"] for state in optimizer.state.values() if torch.is_tensor(state.get("step"))])
    return {"weights": acc["weights"], "grads": acc["grads"], "optimizer": acc["optimizer"] - steps,
            "optimizer_steps": steps}


def model_shape(cfg: GPTConfig | DecoderConfig, name: str = "model") -> ModelShape:
    """The planner's shape of a built model: MiniGPT (GPT-2 imported into it) or a llama-family Decoder."""
    return decoder_shape(cfg, name) if isinstance(cfg, DecoderConfig) else minigpt_shape(cfg, name)


def load_model_folder(folder: Path, device: torch.device, regime: str = "lora") -> nn.Module:
    """A base folder's model (MiniGPT, GPT-2, llama, mistral, qwen2) as finetune reads it for `regime`, through the
    one loader: fp32 for full fine-tuning, the checkpoint's dtype for LoRA and QLoRA (a 16-bit checkpoint's block
    Linears, embeddings and head then stay 16-bit, upcast per product under fp32 compute: ``minituner.upcast``)."""
    return load_base(folder, device, torch.float32 if regime == "full" else None)[0]


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
    and buffer storages are the weights bucket and not counted either. Under gradient checkpointing
    (``model.grad_checkpoint``) torch.utils.checkpoint hides a block's saved tensors behind its own
    hooks and keeps the block's input to recompute it: the inputs still alive at the end are counted.
    """

    def __init__(self, model: nn.Module) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.live: weakref.WeakSet[_Packed] = weakref.WeakSet()
        self.inputs: list[weakref.ref] = []
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed.tensor)
        self._blocks = block_list(model) if getattr(model, "grad_checkpoint", False) else []
        self._handles: list = []

    def _pack(self, t: torch.Tensor) -> _Packed:
        packed = _Packed(t)
        self.live.add(packed)
        return packed

    def _block_input(self, module: nn.Module, args: tuple) -> None:
        # a Decoder layer is called with (x, (cos, sin)): the rotary tensors are inputs the checkpoint holds too
        flat = [t for a in args for t in (a if isinstance(a, (tuple, list)) else (a,))]
        self.inputs += [weakref.ref(t) for t in flat if torch.is_tensor(t)]

    def __enter__(self) -> "SavedTensors":
        self._handles = [b.register_forward_pre_hook(self._block_input) for b in self._blocks]
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        storages = {}
        tensors = [p.tensor for p in list(self.live)] + [t for t in (r() for r in self.inputs) if t is not None]
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in self.exclude:
                storages[s.data_ptr()] = s.nbytes()
        self.bytes = sum(storages.values())


class PeakMemory:
    """High-water mark of the process (CPU: resident set) or of the CUDA allocator, per phase."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = ""
        self.base = 0
        self.phases: dict[str, int] = {}  # phase -> high-water mark (absolute bytes)

    def level(self) -> int:
        """What the process (CPU: resident set) or the CUDA allocator holds now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _rss_bytes("VmRSS") or 0

    def start(self) -> None:
        """Record the baseline (before the model exists)."""
        self.base = self.level()

    def reset_peak(self) -> None:
        """Start the high-water mark afresh at the current level."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.source = "torch.cuda.max_memory_allocated"
            return
        try:  # Linux: writing 5 resets VmHWM to the current resident set
            Path("/proc/self/clear_refs").write_text("5")
            self.source = "resident set high-water mark (VmHWM)"
        except OSError:
            self.source = "ru_maxrss since process start (VmHWM could not be reset)"

    def high_water(self) -> int:
        """The high-water mark since the last reset (absolute bytes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _rss_bytes("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return hwm

    def mark(self, phase: str) -> None:
        """Attribute the high-water mark since the last reset to `phase`, then reset it."""
        self.phases[phase] = max(self.phases.get(phase, 0), self.high_water())
        self.reset_peak()

    def peak(self) -> int:
        return self.high_water() - self.base


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
    predicted: dict[str, int]  # the planner's buckets + "total" + "peak"
    measured: dict[str, int]  # buckets + "optimizer_steps" + "peak" + "baseline" + "peak_raw"
    estimates: dict[str, int]  # other activation estimates: "seed", "korthikanti"
    peak_source: str
    trainable_params: int
    params: int  # the base's parameters by element (a quantized weight too), as the planner counts them
    activation_note: str = "exact model (planner/activations.py)"
    losses: list[float] = field(default_factory=list)
    predicted_phase: str = ""  # where the planner puts the peak (planner/peak.py)
    measured_phases: dict[str, int] = field(default_factory=dict)  # phase -> peak above the process's own memory
    predicted_phases: dict[str, int] = field(default_factory=dict)  # planner phase -> bytes
    base_dtype: str = "float32"  # the dtype the base was read in (a 16-bit checkpoint's, for LoRA and QLoRA)

    @property
    def measured_phase(self) -> str:
        return max(self.measured_phases, key=self.measured_phases.get) if self.measured_phases else ""

    def error(self, predicted: int, measured: int) -> float:
        """Relative error of a prediction, in percent of the measurement."""
        return 100.0 * (predicted - measured) / measured if measured else (0.0 if predicted == 0 else math.inf)

    def rows(self) -> list[tuple[str, int, int, float]]:
        """(bucket, predicted bytes, measured bytes, error %) for the table."""
        out = [(b, self.predicted[b], self.measured[b], self.error(self.predicted[b], self.measured[b])) for b in BUCKETS]
        act = self.measured["activations"]
        out += [(f"activations, {k} estimate", v, act, self.error(v, act)) for k, v in self.estimates.items()]
        out.append(("peak (planner/peak.py)", self.predicted["peak"], self.measured["peak"],
                    self.error(self.predicted["peak"], self.measured["peak"])))
        out.append(("buckets' total (no transients)", self.predicted["total"], self.measured["peak"],
                    self.error(self.predicted["total"], self.measured["peak"])))
        return out

    def to_json(self) -> dict:
        """The `memory-check --json` contract: predicted and measured bytes per bucket, and their relative error.

        ``error`` is (predicted - measured) / measured as a fraction (0.05 = 5% over); ``details`` holds
        what the buckets do not: the run, the phases, the process baseline, the raw peak and the estimates."""
        predicted = {b: self.predicted[b] for b in JSON_BUCKETS}
        measured = {b: self.measured[b] for b in JSON_BUCKETS}
        error = {b: (self.error(predicted[b], measured[b]) / 100 if math.isfinite(self.error(predicted[b], measured[b]))
                     else None) for b in JSON_BUCKETS}
        c = self.check
        details = {
            "model": self.name, "device": self.device, "regime": c.regime, "rank": None if c.regime == "full" else c.rank,
            "targets": c.targets, "batch_size": c.batch_size, "seq_len": c.seq_len, "steps": c.steps,
            "counted_targets": c.counted_targets or c.batch_size * c.seq_len, "grad_accum": c.grad_accum,
            "model_dropout": c.model_dropout, "lora_dropout": c.lora_dropout,
            "precision": c.precision, "grad_checkpoint": c.grad_checkpoint, "base_dtype": self.base_dtype,
            "params": self.params,
            "trainable_params": self.trainable_params, "peak_source": self.peak_source,
            "predicted_peak_phase": self.predicted_phase, "predicted_phases": self.predicted_phases,
            "measured_peak_phase": self.measured_phase, "measured_phases": self.measured_phases,
            "baseline_bytes": self.measured["baseline"], "peak_raw_bytes": self.measured["peak_raw"],
            "buckets_total_bytes": self.predicted["total"],
            "activation_estimates": self.estimates, "optimizer_step_counter_bytes": self.measured["optimizer_steps"],
        }
        return {"predicted": predicted, "measured": measured, "error": error, "details": details}


def predict(cfg: GPTConfig | DecoderConfig, check: CheckConfig, name: str = "model", on_cpu: bool = True,
            base_dtype: torch.dtype | Mapping[str, torch.dtype] = torch.float32
            ) -> tuple[dict[str, int], dict[str, int], str, dict[str, int]]:
    """The planner's buckets and peak for this run (exact activations), the two activation estimates, the
    predicted peak phase and every phase's bytes. fp32: every bucket fp32. bf16: the frozen base in bf16
    (the planner's dtype bf16) but its norms fp32, the LoRA masters, their grads and Adam fp32; activations
    and the peak at bf16 compute's widths (``PRECISION_WIDTHS["bf16"]``). on_cpu False: a CUDA run (attention
    through SDPA, never ``minigpt.native_attention``). base_dtype: the dtype the base was read in, one for the
    whole base or one per part (``memory.stored_dtypes``: a checkpoint that mixes them). Under fp32 (LoRA,
    QLoRA) its bf16 or fp16 parts, block Linears not quantized, embeddings and head, keep 2 bytes per weight and
    bias value (``minituner.upcast``), and its 16-bit block Linears share the dequantization workspace, fp32, as
    large as the largest of them (the head casts a few rows at a time)."""
    shape = model_shape(cfg, name)
    regime = Regime("full") if check.regime == "full" else Regime(check.regime, check.rank)
    dropout = config_dropout(cfg) if check.model_dropout is None else check.model_dropout
    widths = {**PRECISION_WIDTHS[check.precision], "on_cpu": on_cpu, "dropout": dropout,
              "lora_dropout": check.lora_dropout}
    mem = MemoryConfig(batch_size=check.batch_size, seq_len=check.seq_len, full_precision="fp32",
                       activations="exact", dtype="fp32", grad_checkpoint=check.grad_checkpoint)
    b = regime_bytes(shape, regime, check.targets, mem)
    weights = b.weights
    if check.precision == "bf16":
        low = regime_bytes(shape, regime, check.targets, replace(mem, dtype="bf16"))
        # the planner's bf16 weights hold the LoRA factors and the norms at 2 bytes; here the factors are fp32
        # masters (as many bytes as their fp32 grads, b.grads, not their bf16 ones, low.grads) and the norms fp32
        weights = low.weights - low.grads + b.grads + 2 * param_counts(shape)["norm"]
    upcast: frozenset[str] = frozenset()  # paths of the block Linears kept 16-bit and cast per product
    if check.precision == "fp32" and check.regime != "full":
        quantized = set(lora_paths(shape, check.targets)) if check.regime == "qlora" else set()
        kept16 = [lin for lin in shape.linears
                  if lin.path not in quantized and dtype_of(base_dtype, lin.path) in LOW_BITS]
        upcast = frozenset(lin.path for lin in kept16)
        kept = sum(lin.weight_params + (lin.out_features if lin.bias else 0) for lin in kept16) * shape.n_layer
        counts = param_counts(shape)  # and the embeddings and head (upcast.keep_16bit_embeddings, chunk_heads)
        kept += sum(counts[part] for part in EMBEDDING_PARTS if dtype_of(base_dtype, part) in LOW_BITS)
        weights -= 2 * kept  # 2 bytes instead of fp32's 4
    activations = exact_activation_bytes(shape, check.batch_size, check.seq_len, regime.name, regime.rank,
                                         check.targets, grad_checkpoint=check.grad_checkpoint,
                                         counted=check.counted_targets, **widths)
    predicted = {"weights": weights, "grads": b.grads, "optimizer": b.optimizer, "activations": activations}
    predicted["total"] = sum(predicted.values())
    peak = step_peak(shape, check.regime, check.rank, check.targets, check.batch_size, check.seq_len,
                     grad_checkpoint=check.grad_checkpoint, weights=weights, grads=b.grads, optimizer=b.optimizer,
                     upcast=upcast, counted=check.counted_targets, grad_accum=check.grad_accum, **widths)
    predicted["peak"] = peak.bytes
    estimates = {"seed": seed_activation_bytes(shape, check.batch_size, check.seq_len),
                 "korthikanti": korthikanti_activation_bytes(shape, check.batch_size, check.seq_len)}
    return predicted, estimates, peak.phase, {k: sum(v.values()) for k, v in peak.phases.items()}


def warm_up(device: torch.device) -> None:
    """One step of a tiny model, so that the libraries' one-time buffers are not counted in the peak."""
    model = MiniGPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, d_model=8)).to(device)
    opt = adamw(list(model.parameters()), lr=1e-3)  # the training loop's optimizer, fused kernel included
    ids = torch.zeros(1, 5, dtype=torch.long, device=device)
    lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
    opt.step()


def memory_check(build: Callable[[], nn.Module], check: CheckConfig, device: torch.device,
                 name: str = "model") -> CheckResult:
    """Build the model with `build` (on `device`), train check.steps steps on random tokens, measure, predict."""
    check_precision(check.precision, device, check.allow_slow_bf16)
    pinned = device.type == "cpu" and check.pin_allocator and pin_allocator(MMAP_THRESHOLD)
    warm_up(device)
    meter = PeakMemory(device)
    meter.start()
    model = build()
    base_dtype = float_dtype(model)  # before the build for training casts anything
    stored = stored_dtypes((n, p.dtype, p.numel()) for n, p in model.named_parameters())  # part by part
    if check.model_dropout is None:  # the config's, as finetune trains the model
        check = replace(check, model_dropout=config_dropout(model.config))
    check.validate(model.config.block_size)
    if check.model_dropout and (isinstance(model.config, DecoderConfig) or device.type != "cpu"):
        raise InputError(f"the model's dropout ({check.model_dropout:g}) is planned for MiniGPT and GPT-2, and on a "
                         "CPU only (on CUDA attention's dropout runs in fused kernels the exact model does not cover); "
                         "--model-dropout 0 measures the run without it")
    set_model_dropout(model, check.model_dropout)  # before LoRA wraps the Linears: LoRA's own dropout is its config's
    prepare(model, check, device)
    model.to(device).train()
    model.grad_checkpoint = check.grad_checkpoint
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InputError("the model has no trainable parameters")
    opt = adamw(params, lr=1e-4)  # minigpt.train's optimizer, and its step below (clipping at 1.0)
    gen = torch.Generator().manual_seed(check.seed)
    vocab, activations, losses, grads = model.config.vocab_size, 0, [], 0
    first = 1 if check.steps > 1 else 0  # the steady steps: Adam's state and the last step's grads exist
    own = 0  # the process's own memory (everything but live tensors) before the measured steps
    for step in range(check.steps):
        measuring = step >= first
        if step == first:
            if pinned:  # the heap's free pages back to the system: not the process's own (see the docstring)
                trim_heap()
            # live too: QLoRA's workspace, and the logits a bf16 head keeps for the next step (keep_head_output)
            own = meter.level() - account(model, opt)["total"] - workspace_bytes() - kept_output_bytes(model)
            meter.reset_peak()
        micro = [random_batch(vocab, check, gen, device) for _ in range(check.grad_accum)]
        saved = SavedTensors(model)

        def on_phase(phase: str) -> None:
            nonlocal grads
            if phase == "backward":
                grads = state_bytes(model, opt)["grads"]
            if measuring:
                meter.mark(phase)

        counted = check.grad_accum * counted_rows(check.batch_size * check.seq_len, check.counted_targets)
        loss, problem = train_step(model, opt, params, micro, 1.0, forward_context=saved, on_phase=on_phase,
                                   loss_fn=counted_loss(counted, 1) if check.grad_accum > 1 else None)
        if problem is not None:
            raise FloatingPointError(f"{problem} at step {step + 1}")
        activations = max(activations, saved.bytes)
        losses.append(loss.item())
    phases = {k: v - own for k, v in meter.phases.items()}
    measured = {**state_bytes(model, opt), "grads": grads, "activations": activations, "peak": max(phases.values()),
                "baseline": own - meter.base, "peak_raw": max(meter.phases.values()) - meter.base}
    predicted, estimates, phase, predicted_phases = predict(model.config, check, name, on_cpu=device.type == "cpu",
                                                            base_dtype=stored)
    exact = "decoder_activations.py" if isinstance(model.config, DecoderConfig) else "activations.py"
    note = (f"exact model (planner/{exact})" if check.precision == "fp32"
            else f"exact model (planner/{exact}) at bf16 compute's widths (bf16 from each norm to the residual add, "
                 "the fp32 stream and norms, the bf16 copies of the LoRA masters)")
    source = meter.source + (f", glibc mmap threshold pinned at {MMAP_THRESHOLD // 1024} KiB" if pinned else "")
    return CheckResult(name, check, str(device), predicted, measured, estimates, source,
                       sum(p.numel() for p in params), base_params(model), note, losses,
                       phase, phases, predicted_phases, str(base_dtype).removeprefix("torch."))


def random_batch(vocab: int, check: CheckConfig, gen: torch.Generator,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One (x, y) of random tokens, (B, T) each in their own storage; with check.counted_targets the first
    positions do not count (a prompt's), the rest do."""
    ids = torch.randint(vocab, (check.batch_size, check.seq_len + 1), generator=gen)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    if check.counted_targets is not None:
        y.view(-1)[: y.numel() - check.counted_targets] = IGNORE_INDEX
    return x.to(device), y.to(device)


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


def _base_note(base_dtype: str, check: CheckConfig) -> str:
    if base_dtype == "float32":
        return ""
    if check.precision == "fp32":
        return (f"; a {base_dtype} checkpoint: its block Linears not quantized, embeddings and head stay {base_dtype}, "
                "upcast per product")
    return f"; a {base_dtype} checkpoint"


def _counted_note(check: CheckConfig) -> str:
    if check.counted_targets is None:
        return ""
    return (f" with {check.counted_targets:,} of its {check.batch_size * check.seq_len:,} targets counted "
            "(the others -100, as an instruction batch's prompts)")


def describe(result: CheckResult) -> str:
    c = result.check
    what = "full fine-tuning" if c.regime == "full" else f"{c.regime} r={c.rank} on {c.targets}"
    mib = UNITS["MiB"]
    measured = ", ".join(f"{k} {v / mib:,.2f}" for k, v in result.measured_phases.items())
    planned = ", ".join(f"{k} {v / mib:,.2f}" for k, v in result.predicted_phases.items())
    return (f"{result.name}: {result.params:,} base parameters (a quantized weight counted by element), "
            f"{result.trainable_params:,} trainable ({what}); "
            f"batch {c.batch_size} x seq {c.seq_len}{_counted_note(c)}, {c.steps} AdamW steps on {result.device} "
            f"({c.precision}"
            f"{', gradient checkpointing' if c.grad_checkpoint else ''}"
            f"{dropout_phrase(c.model_dropout or 0.0, c.lora_dropout, ', ')}"
            f"{_base_note(result.base_dtype, c)}).\n"
            f"Activations: {result.activation_note}. Adam step counters: {result.measured['optimizer_steps']:,} "
            f"bytes (not planned).\n"
            f"Peak: {result.peak_source}, over the steps after the first, above the process's own memory "
            f"(baseline: {result.measured['baseline'] / mib:,.2f} MiB grown since before the model was built; "
            f"raw peak above that point {result.measured['peak_raw'] / mib:,.2f} MiB).\n"
            f"Measured per phase (MiB): {measured}; at the {result.measured_phase}.\n"
            f"Planned per phase (MiB): {planned}; at the {result.predicted_phase}.")

"""Bytes per bucket (weights, grads, optimizer, activations) for full fine-tuning, LoRA and QLoRA.

Per base parameter N and LoRA parameter P (bytes):
- full, mixed precision: the seed's buckets by default, weights 6N = fp16 copy 2N + fp32 master copy 4N,
  fp16 grads 2N, Adam m and v 8N; MemoryConfig(master_copy="optimizer") is ZeRO's split of the same 16
  bytes/param (Rajbhandari et al. 2020): weights 2N, grads 2N, optimizer 12N = master + m + v.
  full, fp32: 4N + 4N + 8N (no master copy).
- LoRA r: frozen fp16 base 2N, LoRA A/B in fp16 2P, fp16 grads 2P, fp32 Adam m and v 8P (for the
  LoRA parameters only: frozen weights have neither grads nor optimizer state).
- QLoRA r: the targeted Linears' weights in NF4 (the issue's recipe and what wrap_minigpt_qlora does;
  MemoryConfig(quantize="all-linear") instead quantizes every Linear inside the blocks, whichever LoRA
  targets, as bitsandbytes' load_in_4bit does) = 0.5 byte/param + one fp32 absmax per block of 64 (0.0625
  byte/param); with double quantization the absmax is 8-bit in blocks of 256 with one fp32 constant
  each (0.127 bit/param instead of 0.5; Dettmers et al. 2023). Everything not quantized (embeddings,
  norms, biases, an untied head) stays fp16; LoRA as above.
- activations: the seed's estimate batch x seq x d_model x n_layer x 16 bytes or Korthikanti et al.
  2022's s*b*h*(34 + 5*a*s/h) bytes per layer (both the same in every regime), or "exact": the bytes
  the model's forward saves for backward in this regime (planner/activations.py for MiniGPT and GPT-2,
  planner/decoder_activations.py for llama, mistral and qwen2; checked by memory-check).
- peak: with the exact activation model, the largest phase of a training step (planner/peak.py): what
  is alive at the worst moment of the forward, the backward or AdamW's step, transients included.
  MemoryConfig.grad_checkpoint models each block recomputed in backward (it keeps only its input);
  MemoryConfig.model_dropout and lora_dropout a run with dropout on a CPU (masks, attention's math path).
- MemoryConfig.dtype (default fp16) is the float storage of LoRA/QLoRA's frozen weights, LoRA factors and
  grads and of the exact model's activations; "fp32" describes a plain fp32 run (minituner on CPU, or
  with bf16 autocast, which keeps fp32 weights). Adam's m and v are fp32 whatever it says. minituner's
  --precision bf16 (fp32 stream, norms and LoRA masters around a bf16 base) is none of these:
  ``memory-check`` predicts it with the exact model's bf16 widths (``activations.PRECISION_WIDTHS``).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from minigpt.errors import InputError

from .activations import check_dropout_range, counted_rows
from .decoder_activations import EXACT_FAMILIES, exact_activation_bytes
from .counts import ALL_LINEAR, NF4_BLOCK, check_rank, lora_trainable_params, parse_targets, resolve_targets, total_params
from .peak import has_peak_model, step_peak
from .shapes import ModelShape

DQ_BLOCK = 256  # absmax values per fp32 constant under double quantization
SEED_ACT_BYTES = 16  # the seed's bytes per (batch, seq, d_model, layer) element
DEFAULT_RANKS = (4, 8, 16)  # the seed's LoRA regimes; its QLoRA regime uses r = 8
FULL_PRECISIONS = ("mixed", "fp32")
MASTER_COPIES = ("weights", "optimizer")  # full FT mixed: which bucket holds the fp32 master copy (seed / ZeRO)
ACTIVATION_MODELS = ("seed", "korthikanti", "exact")
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
QUANTIZE_CHOICES = ("targets", "all-linear")  # QLoRA: which block Linears are stored in NF4


@dataclass(frozen=True)
class MemoryConfig:
    batch_size: int = 16  # sequences per forward and backward (the seed's default)
    grad_accum: int = 1  # exact model's peak: batches per step, their gradients adding up (gradient accumulation)
    seq_len: int = 32  # tokens per sequence (the seed's default)
    double_quant: bool = False  # QLoRA: quantize the absmax constants too
    full_precision: str = "mixed"  # "mixed": fp16 weights/grads + fp32 master + Adam; "fp32": all fp32
    activations: str = "seed"  # activations bucket: "seed", "korthikanti" or "exact" (best_activation_model picks)
    quantize: str = "targets"  # QLoRA NF4: the LoRA targets, or "all-linear" (every block Linear, bnb load_in_4bit)
    dtype: str = "fp16"  # LoRA/QLoRA float weights, LoRA A/B, grads, exact-model activations: fp16, bf16 or fp32
    master_copy: str = "weights"  # full FT mixed: fp32 master with the weights (the seed, 6N/2N/8N) or "optimizer" (ZeRO, 2N/2N/12N)
    grad_checkpoint: bool = False  # each block recomputed in backward (exact model): it keeps only its input
    # exact model: targets per batch that count (None: all); the head and the loss run on those rows alone
    counted_targets: int | None = None
    # exact model: the model's dropout (MiniGPT, GPT-2: attention, residual and embedding dropout) and LoRA's on its
    # path's input; planned for a CPU run (there dropout keeps float noise, and attention takes SDPA's math path)
    model_dropout: float = 0.0
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if self.full_precision not in FULL_PRECISIONS:
            raise InputError(f"full_precision must be one of {', '.join(FULL_PRECISIONS)}, got {self.full_precision!r}")
        if self.activations not in ACTIVATION_MODELS:
            raise InputError(f"activations must be one of {', '.join(ACTIVATION_MODELS)}, got {self.activations!r}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise InputError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.master_copy not in MASTER_COPIES:
            raise InputError(f"master_copy must be one of {', '.join(MASTER_COPIES)}, got {self.master_copy!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        counted_rows(self.batch_size * self.seq_len, self.counted_targets)  # 1 <= counted_targets <= batch x seq
        if self.counted_targets is not None and self.activations != "exact":
            raise InputError(f"counted_targets needs the exact activation model, not {self.activations!r} (the "
                             "estimates count every position)")
        check_dropout_range(self.model_dropout, "the model's dropout")
        check_dropout_range(self.lora_dropout, "LoRA dropout")
        if (self.model_dropout or self.lora_dropout) and self.activations != "exact":
            raise InputError(f"dropout needs the exact activation model, not {self.activations!r}")


@dataclass(frozen=True)
class Regime:
    name: str  # "full", "lora" or "qlora"
    rank: int | None = None  # LoRA rank r; None for full fine-tuning

    def __post_init__(self) -> None:
        if self.name not in ("full", "lora", "qlora"):
            raise InputError(f"regime must be full, lora or qlora, got {self.name!r}")
        if self.name == "full" and self.rank is not None:
            raise InputError("full fine-tuning has no rank")
        if self.name != "full":
            check_rank(self.rank)

    @property
    def label(self) -> str:
        return "full FT" if self.name == "full" else f"{'LoRA' if self.name == 'lora' else 'QLoRA'} r={self.rank}"


def default_regimes(ranks: Sequence[int] | None = None) -> list[Regime]:
    """No ranks: the seed's five (full, LoRA 4/8/16, QLoRA 8). Ranks: full, LoRA each r, QLoRA each r."""
    if ranks is None:
        return [Regime("full"), *(Regime("lora", r) for r in DEFAULT_RANKS), Regime("qlora", 8)]
    ranks = [check_rank(r) for r in ranks]
    if not ranks:
        raise InputError("give at least one LoRA rank")
    return [Regime("full"), *(Regime("lora", r) for r in ranks), *(Regime("qlora", r) for r in ranks)]


@dataclass(frozen=True)
class Buckets:
    weights: int
    grads: int
    optimizer: int
    activations: int
    peak: int | None = None  # the step's peak (planner/peak.py); None without a peak model for the shape
    peak_phase: str | None = None  # where it occurs

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict:
        d = {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
             "activations": self.activations, "total": self.total}
        if self.peak is not None:
            d.update(peak=self.peak, peak_phase=self.peak_phase)
        return d


@dataclass(frozen=True)
class RegimePlan:
    regime: Regime
    trainable_params: int  # full: every base parameter; LoRA/QLoRA: the LoRA parameters
    frozen_params: int
    bytes: Buckets
    ratio_vs_full: float  # trainable_params / trainable_params of full fine-tuning

    def to_dict(self) -> dict:
        return {"name": self.regime.name, "rank": self.regime.rank, "trainable_params": self.trainable_params,
                "frozen_params": self.frozen_params, "bytes": self.bytes.to_dict(),
                "ratio_vs_full": self.ratio_vs_full}


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    total_params: int
    targets: tuple[str, ...]  # LoRA targets as given (names or all-linear)
    config: MemoryConfig
    regimes: tuple[RegimePlan, ...]

    def to_dict(self) -> dict:
        """The `minituner count --json` contract."""
        return {"model": self.shape.to_dict(), "total_params": self.total_params,
                "regimes": [r.to_dict() for r in self.regimes]}


def nf4_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes of one NF4 tensor: packed 4-bit codes + absmax per 64 (fp32, or 8-bit + fp32 per 256)."""
    blocks = -(-numel // NF4_BLOCK)
    packed = -(-numel // 2)
    if not double_quant:
        return packed + 4 * blocks
    return packed + blocks + 4 * -(-blocks // DQ_BLOCK)


def quantized_params(shape: ModelShape, targets: str | Iterable[str] = ALL_LINEAR) -> int:
    """Parameters QLoRA stores in NF4: the weights of the block Linears these targets select."""
    return shape.n_layer * sum(lin.weight_params for lin in resolve_targets(shape, targets))


def nf4_weight_bytes(shape: ModelShape, double_quant: bool = False, targets: str | Iterable[str] = ALL_LINEAR) -> int:
    return shape.n_layer * sum(nf4_bytes(lin.weight_params, double_quant) for lin in resolve_targets(shape, targets))


def seed_activation_bytes(shape: ModelShape, batch_size: int, seq_len: int) -> int:
    """The seed's estimate: batch x seq x d_model x n_layer x 16 bytes."""
    return batch_size * seq_len * shape.d_model * shape.n_layer * SEED_ACT_BYTES


def korthikanti_activation_bytes(shape: ModelShape, batch_size: int, seq_len: int) -> int:
    """Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer, times n_layer.

    Assumes 16-bit activations, no recomputation and no tensor/sequence parallelism, a GPT block with
    a 4h MLP, dropout masks of 1 byte, and attention that stores the a*s*s score matrix (no
    FlashAttention); embeddings, the final norm and the logits are left out.
    """
    s, b, h, a = seq_len, batch_size, shape.d_model, shape.n_head
    return shape.n_layer * (34 * s * b * h + 5 * a * s * s * b)


def best_activation_model(shape: ModelShape) -> str:
    """The most accurate activation model for this architecture: exact where derived, else Korthikanti et al."""
    return "exact" if shape.family in EXACT_FAMILIES else "korthikanti"


def activation_bytes(shape: ModelShape, cfg: MemoryConfig, regime: Regime = Regime("full"),
                     targets: str | Iterable[str] = ALL_LINEAR) -> int:
    if cfg.activations == "exact":  # depends on the regime: what needs grad decides what is saved
        return exact_activation_bytes(shape, cfg.batch_size, cfg.seq_len, regime.name, regime.rank, targets,
                                      DTYPE_BYTES[cfg.dtype], cfg.grad_checkpoint, counted=cfg.counted_targets,
                                      dropout=cfg.model_dropout, lora_dropout=cfg.lora_dropout)
    fn = seed_activation_bytes if cfg.activations == "seed" else korthikanti_activation_bytes
    return fn(shape, cfg.batch_size, cfg.seq_len)


def regime_bytes(shape: ModelShape, regime: Regime, targets: str | Iterable[str] = ALL_LINEAR,
                 cfg: MemoryConfig = MemoryConfig()) -> Buckets:
    b = _buckets(shape, regime, targets, cfg)
    if cfg.activations != "exact" or not has_peak_model(shape) or (regime.name == "qlora" and cfg.quantize != "targets"):
        return b
    grad_bytes = 4 if regime.name == "full" and cfg.full_precision == "fp32" else (
        2 if regime.name == "full" else DTYPE_BYTES[cfg.dtype])
    peak = step_peak(shape, regime.name, regime.rank, targets, cfg.batch_size, cfg.seq_len, DTYPE_BYTES[cfg.dtype],
                     cfg.grad_checkpoint, weights=b.weights, grads=b.grads, optimizer=b.optimizer,
                     grad_bytes=grad_bytes, counted=cfg.counted_targets, dropout=cfg.model_dropout,
                     lora_dropout=cfg.lora_dropout, grad_accum=cfg.grad_accum)
    return replace(b, peak=peak.bytes, peak_phase=peak.phase)


def _buckets(shape: ModelShape, regime: Regime, targets: str | Iterable[str], cfg: MemoryConfig) -> Buckets:
    n = total_params(shape)
    act = activation_bytes(shape, cfg, regime, targets)
    if regime.name == "full":
        if cfg.full_precision == "fp32":
            return Buckets(weights=4 * n, grads=4 * n, optimizer=8 * n, activations=act)
        if cfg.master_copy == "optimizer":  # ZeRO's split: master copy + m + v are optimizer state
            return Buckets(weights=2 * n, grads=2 * n, optimizer=12 * n, activations=act)
        return Buckets(weights=6 * n, grads=2 * n, optimizer=8 * n, activations=act)  # the seed's: fp16 + fp32 master
    p, b = lora_trainable_params(shape, regime.rank, targets), DTYPE_BYTES[cfg.dtype]
    if regime.name == "lora":
        base = b * n
    else:
        quantized = targets if cfg.quantize == "targets" else ALL_LINEAR
        q = quantized_params(shape, quantized)
        base = nf4_weight_bytes(shape, cfg.double_quant, quantized) + b * (n - q)
    return Buckets(weights=base + b * p, grads=b * p, optimizer=8 * p, activations=act)


def plan(shape: ModelShape, regimes: Sequence[Regime] | None = None, targets: str | Iterable[str] = ALL_LINEAR,
         cfg: MemoryConfig = MemoryConfig()) -> Plan:
    """Counts and bytes of each regime (default: the seed's five) for this shape and these LoRA targets."""
    names = parse_targets(targets)
    wrapped = resolve_targets(shape, names)  # unknown names fail here, before any arithmetic
    regimes = list(regimes) if regimes is not None else default_regimes()
    narrowest = min(wrapped, key=lambda lin: min(lin.in_features, lin.out_features), default=None)
    side = min(narrowest.in_features, narrowest.out_features) if narrowest else None
    for regime in regimes:  # as apply_lora refuses it: a rank past a wrapped Linear's smaller side
        if regime.name != "full" and side is not None and regime.rank > side:
            raise InputError(f"LoRA rank r={regime.rank} exceeds min(in, out) = {side} of {narrowest.path}")
    n = total_params(shape)
    rows = []
    for regime in regimes:
        trainable = n if regime.name == "full" else lora_trainable_params(shape, regime.rank, names)
        frozen = 0 if regime.name == "full" else n
        rows.append(RegimePlan(regime, trainable, frozen, regime_bytes(shape, regime, names, cfg), trainable / n))
    return Plan(shape, n, names, cfg, tuple(rows))

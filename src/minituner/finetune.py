"""Fine-tune a base folder (MiniGPT, GPT-2, Llama, Mistral, Qwen2) with LoRA, QLoRA or fully (minigpt.train.train).

The data is plain text, or instruction and chat data (.jsonl/.json/.parquet/.arrow, builtin:forecast-qa) trained on
the answers only (finetune_data).

A LoRA run writes ``adapter_final.safetensors`` (minituner-lora-v1, see adapter_io), ``adapter_peft/``
(a PEFT folder), ``metrics.jsonl``, ``loss_curve.png`` and ``manifest.json`` (sha256 of base and adapter).
A full fine-tune writes a complete base folder instead of the adapter (a Hugging Face folder for a
Hugging Face decoder).

How the base is loaded (``load_base``, then ``build_for_training``): full fine-tuning reads it in float32;
LoRA keeps the checkpoint's dtype (a bf16 base's Linears, embeddings and head stay bf16; in fp32 on CPU each
product casts its weight to fp32, ``minituner.upcast``; the factors are float32); QLoRA quantizes the targets as
they are read, so the full-precision model is never in memory at once. The losses before training are the built base's (adapters off),
computed as training computes.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.base_folder import MANIFEST, WEIGHTS, WEIGHTS_INDEX, save_base
from minigpt.bf16_support import bf16_support
from minigpt.decoder import Decoder
from minigpt.run_dir import check_inputs_outside_run, check_run_dir, replacing_run
from minigpt.train_state import CHECKPOINT_DIR
from minigpt.data import FINETUNE_DATA, PRETRAIN_DATA
from minigpt.device import check_precision
from minigpt.distributed import barrier, is_writer
from minigpt.errors import InputError
from minigpt.manifest import seed_everything, write_manifest
from minigpt.train import TrainConfig, evaluate, train
from miniquant import DEFAULT_QUANT_SCHEME

from .base_model import (Tokenizer, base_config, base_kind, base_weights_file, base_weights_sha256, default_seq_len,
                         load_base)
from .build import FULL_IN_BF16, build_for_training
from .dropout import config_dropout, set_model_dropout
from .adapter_io import ADAPTER_FILE, check_same_scaling, save_adapter
from .export import write_hf_folder
from .finetune_data import (  # noqa: F401 (steps_for_epochs: API)
    domain_unknown_fraction, encode_domain, steps_for_epochs, training_data)
from .lora import LoRAConfig, trainable_numel
from .memory.run_plan import describe_run_plan, plan_run
from .planner.activations import check_dropout_range
from .planner.memory import Regime
from .peft_format import save_peft_adapter
from .qlora import check_scheme, logical_numel
from .run_record import base_file_stats
from .sft import FORMATS, SFTConfig
from .sft.formats import DataSelection, check_columns, check_data_splits
from .sft.templates import TEMPLATE_FILE, save_chat_template
from .zoo import adapters_disabled

DEFAULT_DATA = FINETUNE_DATA
BASE_DOMAIN = PRETRAIN_DATA  # val loss here before/after shows what fine-tuning forgets
UNREADABLE_DOMAIN = 0.01  # above this fraction of the base domain's text <unk> to the tokenizer, finetune says so
PEFT_DIR = "adapter_peft"
# what a LoRA run writes, which a new run in the same folder replaces: any of these, and the folder holds a run
# (refused without --overwrite or --resume); a full fine-tune writes a whole base folder (WEIGHTS and the rest)
RUN_MARKERS = (MANIFEST, "metrics.jsonl", ADAPTER_FILE, WEIGHTS, WEIGHTS_INDEX, PEFT_DIR, "loss_curve.png",
               TEMPLATE_FILE)
LORA_RUN_FILES = (*RUN_MARKERS, CHECKPOINT_DIR)
FULL_RUN_FILES = (*LORA_RUN_FILES, "model-*-of-*.safetensors", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_train_config() -> TrainConfig:
    """Fine-tuning defaults: fewer steps and a short warmup; LoRA on MiniGPT tolerates a high LR."""
    return TrainConfig(steps=300, batch_size=32, lr=5e-3, warmup_steps=20, eval_every=50)


@dataclass
class FinetuneConfig:
    data: str = DEFAULT_DATA  # builtin:NAME, a text file or folder, or instruction data (.jsonl/.json/.parquet/.arrow)
    method: str = "lora"  # "lora" (train adapters only) or "full" (every parameter)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    train: TrainConfig = field(default_factory=default_train_config)
    epochs: float | None = None  # if set, steps = ceil(epochs · train tokens / (batch_size · grad_accum · block));
    # for instruction data ceil(epochs · train examples / (batch_size · grad_accum))
    init_adapter: str | None = None  # start LoRA from this adapter (file, run folder or PEFT folder)
    allow_other_base: bool = False  # init_adapter put on this base though its recorded base differs
    base_domain: str | None = BASE_DOMAIN  # also report val loss here before/after (forgetting); None skips
    quant_scheme: str | None = None  # QLoRA: quantize the LoRA targets (e.g. nf4_per_group_64) first; None: LoRA
    allow_unknown_chars: bool = False  # train on characters the base tokenizer never saw (as <unk>) instead of refusing
    seq_len: int | None = None  # training window in tokens; None: MiniGPT's block size, else min(context, 512)
    format: str | None = None  # a data file's shape (sft.FORMATS); None: recognised per file from its fields
    train_on_inputs: bool = False  # instruction data: count prompt/user tokens in the loss too (default: answers only)
    overlong: str = "truncate"  # instruction data: an example longer than the block is "truncate"d or "drop"ped
    model_dropout: float | None = None  # the model's own dropout while training; None: its config's (GPT-2's 0.1)
    chat_template: str | None = None  # instruction data: a Jinja file rendering its chats in place of the base's
    columns: tuple[tuple[str, str], ...] = ()  # instruction data: (field a shape reads, the data's column) renames
    data_config: str | None = None  # a data set folder's dataset card config (subset); None: the unnamed one
    data_splits: tuple[tuple[str, str], ...] = ()  # (train|val|test, the data set's split read as it); (): by name

    def selection(self) -> DataSelection:
        """Which records of the data set to read (--data-config, --data-split, --columns)."""
        return DataSelection(self.data_config, tuple(map(tuple, self.data_splits)), tuple(map(tuple, self.columns)))

    def validate(self) -> None:
        if self.method not in ("lora", "full"):
            raise InputError(f"method must be 'lora' or 'full', got {self.method!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise InputError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if self.format is not None and self.format not in FORMATS:
            raise InputError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        SFTConfig(self.train_on_inputs, self.overlong).validate()
        check_columns(tuple(map(tuple, self.columns)))  # (field, column) pairs, as --columns gives them
        check_data_splits(tuple(map(tuple, self.data_splits)))  # (split, name) pairs, as --data-split gives them
        if self.model_dropout is not None:
            check_dropout_range(self.model_dropout, "the model's dropout")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise InputError(f"epochs must be a positive number, got {self.epochs}")
        if self.method == "lora":
            self.lora.validate()
        if self.quant_scheme is not None:
            if self.method != "lora":
                raise InputError("QLoRA (quant_scheme) trains LoRA on a quantized base; it cannot be full fine-tuning")
            check_scheme(self.quant_scheme)
        self.train.validate()
        if self.method == "full" and self.train.precision == "bf16":
            raise InputError(FULL_IN_BF16)


@dataclass
class FinetuneResult:
    model: nn.Module  # the trained model (LoRA-wrapped for method "lora")
    tokenizer: Tokenizer
    summary: dict  # the numbers written to manifest.json["results"]


def _batches_per_step(cfg: TrainConfig) -> str:
    """" of N batches of B each" for gradient accumulation, else ""."""
    return f" of {cfg.grad_accum} batches of {cfg.batch_size} each" if cfg.grad_accum > 1 else ""


def domain_val_loss(model: nn.Module, tokenizer: Tokenizer, source: str, train_cfg: TrainConfig,
                    block: int | None = None) -> float:
    """Validation loss (nats/token) of `model` on the val split of a corpus, in windows of `block` (default: context)."""
    block = block or model.config.block_size
    _, val_ids = encode_domain(source, tokenizer, block)
    return evaluate(model, val_ids, block, train_cfg.batch_size, train_cfg.eval_batches)


def training_window(base: Path, seq_len: int | None) -> int:
    """seq_len, or the base's default window (default_seq_len); longer than the model's context is an InputError."""
    context = base_config(base).block_size
    n = seq_len or default_seq_len(base)
    if n > context:
        raise InputError(f"--seq-len {n} exceeds the model's context of {context} tokens ({base}/config.json)")
    return n


def finetune(base: str | Path, out: str | Path, cfg: FinetuneConfig, progress: bool = True, log=print,
             overwrite: bool = False, resume: bool = False, device: str | torch.device = "cpu",
             allow_slow_bf16: bool = False, heap_trims: bool = True) -> FinetuneResult:
    """Fine-tune the base folder `base` on cfg.data, write the run to `out`, return the model and numbers.

    A folder that already holds a run is refused unless `overwrite` (start over) or `resume` (continue from
    its newest checkpoint, bit-identically on CPU: cfg must be the one the run started with). Under torchrun
    every rank trains (minigpt.distributed) and rank 0 alone logs and writes. cfg.train.precision "bf16" is
    refused where bf16 would run slower than fp32 unless `allow_slow_bf16` (not part of the run's identity).
    `heap_trims` (CPU; not part of the run's identity either) hands freed heap pages back during each forward
    (``minituner.memory.heap``): a lower peak, steps a few percent slower.
    """
    cfg.validate()
    bf16 = check_precision(cfg.train.precision, torch.device(device), allow_slow_bf16)  # before anything is loaded
    start = time.perf_counter()
    base, out = Path(base), Path(out)
    if out.resolve() == base.resolve():
        raise InputError("--out must differ from --base (the base folder is never written)")
    check_run_dir(out, RUN_MARKERS, overwrite, resume)
    full = (out / WEIGHTS).exists() or (out / WEIGHTS_INDEX).exists()  # the earlier run, if any, was a full FT
    files = FULL_RUN_FILES if full else LORA_RUN_FILES
    if overwrite:
        check_inputs_outside_run(out, files, RUN_MARKERS, {
            "--data": cfg.data, "--init-adapter": cfg.init_adapter, "--chat-template": cfg.chat_template,
            "--base-domain": cfg.base_domain})
    if cfg.init_adapter is not None:
        check_same_scaling(cfg.init_adapter, cfg.lora)
    barrier()  # every rank has checked the folder before rank 0 writes to it
    writer = is_writer()
    progress, log = progress and writer, log if writer else (lambda *a, **k: None)
    with replacing_run(out, files, RUN_MARKERS, active=writer, resuming=resume):  # a failed run leaves it as it was
        return _finetune(base, out, cfg, progress, log, resume, device, allow_slow_bf16, heap_trims, bf16, start,
                         writer)


def _finetune(base: Path, out: Path, cfg: FinetuneConfig, progress: bool, log, resume: bool, device,
              allow_slow_bf16: bool, heap_trims: bool, bf16, start: float, writer: bool) -> FinetuneResult:
    """finetune's run once its folder is checked: load, build, train, write."""
    block = training_window(base, cfg.seq_len)  # from config.json, before any weight is read
    seed_everything(cfg.train.seed)
    method = "qlora" if cfg.quant_scheme else cfg.method
    # full: float32 weights; LoRA: the checkpoint's dtype; QLoRA: the targets quantized as they are read
    quantize = (cfg.lora.target_modules, cfg.quant_scheme) if method == "qlora" else None
    model, tokenizer = load_base(base, device, torch.float32 if method == "full" else None, quantize)
    if tokenizer is None:
        raise InputError(f"{base}: no tokenizer.json beside the model")
    dropout = config_dropout(model.config)  # the config's, unless cfg.model_dropout sets another
    if cfg.model_dropout is not None:  # before LoRA wraps the Linears (LoRA's dropout is its own)
        set_model_dropout(model, cfg.model_dropout)
    data = training_data(cfg.data, base, tokenizer, block, cfg.train, cfg.format,
                         SFTConfig(cfg.train_on_inputs, cfg.overlong), cfg.allow_unknown_chars, log,
                         Path(cfg.chat_template) if cfg.chat_template else None, cfg.selection())
    unk = data.unk_fraction  # fraction of characters that would be <unk>
    if unk > 0.01:
        log(f"warning: {unk:.1%} of the training characters are unknown to the base tokenizer (<unk>)")
    regime = Regime("full") if method == "full" else Regime(method, cfg.lora.r)
    memory_plan, why = plan_run(base, regime, cfg.lora.target_modules, data.largest, cfg.train.grad_checkpoint,
                                cfg.train.precision, torch.device(device), cfg.quant_scheme, cfg.lora.dropout,
                                cfg.model_dropout, cfg.train.grad_accum)
    for line in describe_run_plan(memory_plan, why):
        log(line)
    train_cfg = cfg.train
    if cfg.epochs is not None:  # the steps of the passes; warm-up and the eval interval at most that many, as --steps
        steps = data.steps_for_epochs(cfg.epochs, cfg.train.grad_accum)
        train_cfg = TrainConfig(**{**asdict(train_cfg), "steps": steps,
                                   "warmup_steps": min(train_cfg.warmup_steps, steps),
                                   "eval_every": min(train_cfg.eval_every, steps)})
    n_params = logical_numel(model)  # a QLoRA base is already quantized: its weights count by element

    lora_cfg = cfg.lora
    # fp32: QLoRA and full FT in fp32 on every device, LoRA in the dtype the base was read in (a 16-bit checkpoint is
    # not upcast); bf16 (cfg.train.precision): minituner.precision's path (bf16 frozen base, fp32 norms and masters)
    compute = None if train_cfg.precision == "bf16" or method == "lora" else torch.float32
    build_for_training(model, method, lora_cfg, cfg.quant_scheme or DEFAULT_QUANT_SCHEME, device, compute,
                       precision=train_cfg.precision, allow_slow_bf16=allow_slow_bf16, init_adapter=cfg.init_adapter,
                       heap_trims=heap_trims)
    with adapters_disabled(model):  # the base's losses (a QLoRA base quantized), computed as training computes
        val_before = data.val_loss(model)
        base_before = domain_val_loss(model, tokenizer, cfg.base_domain, train_cfg, block) if cfg.base_domain else None
    base_unk = domain_unknown_fraction(cfg.base_domain, tokenizer) if cfg.base_domain else None
    unreadable = f" ({base_unk:.1%} <unk>)" if base_unk is not None and base_unk > UNREADABLE_DOMAIN else ""
    trainable = trainable_numel(model)
    label = f"{method} ({cfg.quant_scheme})" if cfg.quant_scheme else method  # qlora (nf4_per_group_64)
    log(f"{label}: {trainable:,} of {n_params:,} parameters trainable ({trainable / n_params:.2%}); "
        f"{data.description}; {train_cfg.steps} steps{_batches_per_step(train_cfg)} in {train_cfg.precision}")
    if train_cfg.precision == "fp32" and method != "full" and torch.device(device).type == "cpu":
        units = bf16_support("cpu")  # LoRA and QLoRA in fp32 on a CPU that runs bf16 products far faster
        if units.fast:
            log(f"note: {units.reason}: --precision bf16 would run the products on them (LoRA masters, norms "
                "and loss stay fp32): several times faster steps on CPUs with AMX (benchmarks/RESULTS.md)")
    if bf16 is not None and not bf16.fast:
        log(f"warning: {bf16.reason}: bf16 runs slower than fp32 here (--allow-slow-bf16)")
    if unreadable:
        log(f"note: {base_unk:.1%} of {cfg.base_domain}'s val text is unknown to the base's tokenizer (<unk>): "
            "the loss there says little about what fine-tuning forgets; --base-domain DATA names text the base "
            "reads (none skips the check)")

    out.mkdir(parents=True, exist_ok=True)
    base_files, (base_sha, base_bytes) = base_file_stats(base), base_weights_sha256(base)  # stats first: as hashed
    # the model's dropout joins the run's identity only where it is not the config's (runs before the flag resume)
    changed = {"model_dropout": cfg.model_dropout} if config_dropout(model.config) != dropout else {}
    # the chat template and the data's selection (config, splits, columns) are in the data's identity (the examples
    # they give), not here: runs from before these flags resume
    fingerprint = {"base_sha256": base_sha, **changed,
                   **{k: v for k, v in asdict(cfg).items()
                      if k not in ("train", "model_dropout", "chat_template", "columns", "data_config", "data_splits")}}
    result = train(model, data.train_ids, data.val_ids, train_cfg, out_dir=out, progress=progress, resume=resume,
                   fingerprint=fingerprint, log=log, block_size=block, batches=data.batches,
                   val_loss=data.val_loss if data.batches else None, data_identity=data.data_identity)
    if not math.isfinite(result.final_val_loss):
        raise FloatingPointError(f"validation loss is {result.final_val_loss}; no adapter or model was written")
    base_after = domain_val_loss(model, tokenizer, cfg.base_domain, train_cfg, block) if cfg.base_domain else None

    if not writer:
        return FinetuneResult(model, tokenizer, {})
    if cfg.method == "lora":
        artifact = save_adapter(model, out / ADAPTER_FILE, base_sha256=base_sha)  # checked where it goes alone
        save_peft_adapter(model, out / PEFT_DIR, base_model_name_or_path=str(base))
    elif isinstance(model, Decoder) or base_kind(base) == "gpt2":  # a Hugging Face folder, as the base was:
        write_hf_folder(model, base, out, torch.float32)  # loadable by load_base and by transformers
        artifact = base_weights_file(out)
    else:
        save_base(model, tokenizer, out)
        artifact = out / WEIGHTS
    if data.template is not None:  # the chats were rendered with it: generate, eval and export use it with the run
        save_chat_template(out, data.template)
    summary = {
        "method": cfg.method,
        "params_total": n_params,
        "params_trainable": trainable,
        "trainable_fraction": trainable / n_params,
        "steps": train_cfg.steps,
        **data.results,  # train_tokens, val_tokens; for instruction data "sft": stats and template
        "unk_fraction": unk,
        "val_loss_before": val_before,
        "val_loss_after": result.final_val_loss,
        "base_domain": cfg.base_domain,
        "base_domain_val_loss_before": base_before,
        "base_domain_val_loss_after": base_after,
        "base_domain_unk_fraction": base_unk,  # of its val text's characters (None: no base domain)
        "base_bytes": base_bytes,
        "artifact_bytes": artifact.stat().st_size,
        "train_wall_time_s": result.wall_time_s,
        "skipped_steps": result.skipped_steps,
        "memory_plan": memory_plan,  # planner/peak.py's step peak at the data's largest batch (None: not planned)
    }
    write_manifest(
        out / MANIFEST,
        seed=train_cfg.seed,
        config={"base": str(base), "data": cfg.data, "format": cfg.format, "train_on_inputs": cfg.train_on_inputs,
                "overlong": cfg.overlong, "method": cfg.method, "epochs": cfg.epochs, "seq_len": block,
                "init_adapter": cfg.init_adapter, "quant_scheme": cfg.quant_scheme,
                **({"columns": dict(cfg.columns)} if cfg.columns else {}),
                **({"data_config": cfg.data_config} if cfg.data_config else {}),
                **({"data_splits": dict(cfg.data_splits)} if cfg.data_splits else {}),
                **({"chat_template": cfg.chat_template} if cfg.chat_template else {}),
                **({"allow_other_base": True} if cfg.allow_other_base else {}),  # --init-adapter's base unchecked
                "model_dropout": config_dropout(model.config),  # what it trained with (--model-dropout or config's)
                "lora": lora_cfg.to_dict() if cfg.method == "lora" else None,
                "train": asdict(train_cfg), "model": model.config.to_dict()},
        wall_time_s=time.perf_counter() - start,
        adapter=artifact if cfg.method == "lora" else None,
        extra={"base_sha256": base_sha, "base_files": base_files, "results": summary, "resumes": result.resumes,
               **({} if cfg.method == "lora" else {"finetuned_sha256": base_weights_sha256(out)[0]})},
    )
    log(f"val loss on {cfg.data}: {val_before:.3f} -> {result.final_val_loss:.3f} nats/token"
        + (f"; on {cfg.base_domain}{unreadable}: {base_before:.3f} -> {base_after:.3f}" if cfg.base_domain else ""))
    return FinetuneResult(model, tokenizer, summary)

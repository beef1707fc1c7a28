"""minituner count: trainable/frozen parameters and memory of full FT, LoRA and QLoRA, by arithmetic."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from minigpt.errors import InputError
from minigpt.train import EVAL_LOGITS_BYTES
from minituner.base_model import default_seq_len, model_config
from minituner.finetune import default_train_config
from minituner.finetune_data import largest_data_batch
from minituner.memory.run_plan import counted_phrase, finetune_plan
from minituner.planner import (ALL_LINEAR, PRESETS, MemoryConfig, config_context, default_regimes, load_config_shape,
                               minigpt_vocab, plan, preset_context, preset_shape)
from minituner.planner.memory import (ACTIVATION_MODELS, FULL_PRECISIONS, MASTER_COPIES, QUANTIZE_CHOICES,
                                      best_activation_model)
from minituner.planner.activations import dropout_phrase
from minituner.planner.presets import MINIGPT_SIZES
from minituner.planner.report import UNITS, describe, regime_table
from minituner.sft import LargestBatch, SFTConfig

from ._common import add_sft_arguments, data_selection, positive_float, positive_int

HELP = "count trainable/frozen parameters and memory (weights, grads, optimizer, activations) per regime"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, help="built-in shape (default minigpt)")
    src.add_argument("--config", type=Path, help="config.json (or its folder): Hugging Face gpt2/llama/mistral/qwen2 or a MiniGPT base")
    src.add_argument("--base", type=Path, metavar="FOLDER",
                     help="a model folder (as finetune --base takes): planned from its config.json and tensor "
                          "headers, no weights read; adds the CPU run finetune makes from it (fp32 compute)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json giving MiniGPT presets their vocab_size "
                   "(default artifacts/base/tokenizer.json if present, else rebuilt from the built-in corpus)")
    p.add_argument("--rank", action="append", metavar="R[,R...]",
                   help="LoRA rank(s), repeatable (default: the seed's full, LoRA 4/8/16, QLoRA 8)")
    p.add_argument("--alpha", type=positive_float, help="lora_alpha (shown; scales the update, changes no count)")
    p.add_argument("--target", action="append", metavar="NAME[,NAME...]",
                   help=f"LoRA target module names, or {ALL_LINEAR} (default; never the output head)")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"sequences per step (default {MemoryConfig.batch_size}, the seed's; with --data "
                        f"{default_train_config().batch_size}, finetune's)")
    p.add_argument("--grad-accum", type=positive_int, default=1, metavar="N",
                   help="exact model: N batches per step, their gradients adding up, as finetune's --grad-accum "
                        "(each backward after the first holds every gradient; default %(default)s)")
    p.add_argument("--seq-len", type=positive_int,
                   help=f"tokens per sequence (default {MemoryConfig.seq_len}, the seed's; with --config or --base "
                        "at most the model's context, as finetune and memory-check require)")
    p.add_argument("--double-quant", action="store_true", help="QLoRA double quantization of the absmax constants")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="targets",
                   help="QLoRA: NF4 for the LoRA targets (default) or every block Linear (bitsandbytes load_in_4bit)")
    p.add_argument("--full-precision", choices=FULL_PRECISIONS, default="mixed",
                   help="full FT: fp16 + fp32 master (mixed, default) or plain fp32")
    p.add_argument("--master-copy", choices=MASTER_COPIES, default=MemoryConfig.master_copy,
                   help="full FT mixed: count the fp32 master copy with the weights (the seed: 6N/2N/8N, default) "
                   "or with the optimizer state (ZeRO: 2N/2N/12N); same total")
    p.add_argument("--activations", choices=ACTIVATION_MODELS, default=None,
                   help="activation model: exact (what the forward saves, derived for MiniGPT, GPT-2 and the llama "
                        "family; with the step's peak), the seed's B*T*d*L*16 bytes, or Korthikanti et al. 2022 "
                        "(default: the most accurate for the architecture, exact for every family count reads)")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="exact model: each block recomputed in backward (it keeps only its input)")
    p.add_argument("--counted-targets", type=positive_int, metavar="N",
                   help="exact model: targets per batch that count in the loss (default: all); an instruction batch "
                        "counts its answers only, and the head and the loss run on those rows alone")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="exact model: dropout on the LoRA path's input, as finetune's --dropout (default %(default)s)")
    p.add_argument("--model-dropout", type=float, metavar="P",
                   help="exact model, MiniGPT and GPT-2: the model's own dropout, as finetune's --model-dropout, "
                        "kept as a CPU run keeps it (default: 0 in the planner's table; the config's in the table of "
                        "the run finetune makes from --base)")
    p.add_argument("--data", metavar="SOURCE",
                   help="with --base: plan the largest batch finetune can draw from this data (.jsonl, .json, "
                        ".parquet or .arrow instruction or chat data read as finetune reads it; plain text fills "
                        "--seq-len): its "
                        "longest example and its most-counted example in every row; --seq-len is then the "
                        "training window (default finetune's)")
    add_sft_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def parse_ranks(values: list[str] | None) -> list[int] | None:
    """["8", "16"] or ["8,16"] -> [8, 16]; anything else (0, -1, "x") is an InputError."""
    if not values:
        return None
    ranks = []
    for text in (t.strip() for v in values for t in v.split(",")):
        try:
            r = int(text)
        except ValueError:
            r = None
        if r is None or r < 1:
            raise InputError(f"--rank must be positive integers such as 8 or 8,16, got {text!r}")
        if r not in ranks:  # (8,8: one row each)
            ranks.append(r)
    return ranks


def _window(config: Path, seq_len: int | None) -> tuple[int, str | None]:
    """(tokens per sequence to plan, a note or None) for a model config: --seq-len (refused beyond the model's
    context, as finetune refuses it), else the seed's default cut to the context. A model that counts but that
    finetune would refuse (e.g. an unsupported rope_scaling type: frequencies, not shapes) is planned, noted."""
    try:
        model_config(config)  # every check finetune's loader makes
        note = None
    except InputError as e:
        note = f"planned from its shapes, but finetune would refuse this model: {e}"
    context = config_context(config)
    if seq_len is not None and seq_len > context:
        raise InputError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens ({config})")
    return seq_len or min(MemoryConfig.seq_len, context), note


def finetune_table(run: dict, from_data: bool = False, dropout_from: str = "config.json") -> str:
    """finetune_plan as a paragraph and a Markdown table (MiB, or GiB past 10 GiB); dropout_from: where the model's
    dropout came from."""
    unit = "GiB" if max(r["peak"] for r in run["regimes"]) >= 10 * UNITS["GiB"] else "MiB"
    kept = ("" if run["base_dtype"] == "float32" else
            f"; a {run['base_dtype']} checkpoint: Linears not quantized, embeddings and head stay {run['base_dtype']}, "
            "cast to fp32 per product; full FT reads it in float32")
    if "stored_dtypes" in run:
        by_dtype: dict[str, list[str]] = {}
        for part, dtype in run["stored_dtypes"].items():
            by_dtype.setdefault(dtype, []).append(part)
        kept = ("; a checkpoint mixing float dtypes, each part kept as stored for LoRA and QLoRA ("
                + "; ".join(f"{d}: {', '.join(parts)}" for d, parts in sorted(by_dtype.items()))
                + "), 16-bit parts cast to fp32 per product; full FT reads it in float32")
    lines = [f"As `finetune --base` runs it on CPU with --precision fp32 (its default): fp32 compute and activations"
             f"{kept}; QLoRA's targets in NF4 (blocks of 64, finetune's default scheme); LoRA factors, grads and "
             f"AdamW fp32{_dropouts(run, dropout_from)}; "
             f"batch {run['batch_size']} x seq {run['seq_len']}{_counted(run)}{_accumulated(run)}, "
             f"{_batch_origin(from_data)}. "
             "The step peak as "
             "`memory-check --base` predicts it (planner/peak.py); the process itself (Python, torch) comes on top.",
             "",
             f"| regime | weights {unit} | grads {unit} | optimizer {unit} | activations {unit} | step peak {unit} "
             "| peak at |", "|---|---|---|---|---|---|---|"]
    for r in run["regimes"]:
        cells = " | ".join(f"{r[k] / UNITS[unit]:,.2f}" for k in ("weights", "grads", "optimizer", "activations", "peak"))
        lines.append(f"| {r['regime']} | {cells} | {r['peak_phase']} |")
    return "\n".join(lines)


def _dropouts(run: dict, dropout_from: str) -> str:
    """The run's dropout: the model's from its config or --model-dropout (with what it does to attention), LoRA's
    from --dropout."""
    model = (f"the model's dropout {run['model_dropout']:g} ({dropout_from}; attention on SDPA's math path)"
             if run["model_dropout"] else "")
    return "; " + " and ".join(filter(None, [model, dropout_phrase(0.0, run["lora_dropout"])])) \
        if model or run["lora_dropout"] else ""


def _batch_origin(from_data: bool) -> str:
    if from_data:
        return "the largest batch of --data (above)"
    return "count's --batch-size and --seq-len (finetune's defaults differ: give both the ones you will train with)"


def _accumulated(run: dict) -> str:
    n = run.get("grad_accum", 1)
    return f", {n} batches a step (gradient accumulation)" if n > 1 else ""


def _counted(run: dict) -> str:
    counted = counted_phrase(run["batch_size"], run["seq_len"], run["counted_targets"])
    return counted and f" with {counted}"


def data_batch(args: argparse.Namespace, batch_size: int) -> tuple[LargestBatch | None, str | None]:
    """The largest batch finetune makes from --data and a note when finetune would refuse the data ((None, None)
    without --data); --data needs --base."""
    sft_flags = (args.format is not None or args.train_on_inputs or args.overlong != "truncate"
                 or args.chat_template is not None or bool(data_selection(args).flags()))
    if args.data is None:
        if sft_flags:
            raise InputError("--format, --columns, --data-config, --data-split, --chat-template, --train-on-inputs and "
                             "--overlong apply to --data")
        return None, None
    if args.base is None:
        raise InputError("--data needs --base: the folder's tokenizer and chat template read it as finetune does")
    if args.counted_targets is not None:
        raise InputError("--data and --counted-targets both say how many targets count: give one")
    window = args.seq_len or default_seq_len(args.base)
    return largest_data_batch(args.data, args.base, window, batch_size, args.format,
                              SFTConfig(train_on_inputs=args.train_on_inputs, overlong=args.overlong),
                              args.chat_template, data_selection(args))


def describe_batch(batch: LargestBatch, source: str) -> str:
    """One paragraph: the batch count planned from --data, and why it is the largest."""
    every = batch.batch_size * batch.seq_len
    return (f"Data {source}: planned at the largest batch finetune makes from it, {batch.batch_size} x "
            f"{batch.seq_len} positions (its longest example, train or val) with {batch.counted:,} of the {every:,} "
            f"targets counted (its most-counted example in every row: training draws with replacement); an average "
            f"batch counts {batch.mean_counted:,.0f}. No training step of the run needs more memory than planned "
            f"here; evaluation (not planned) keeps no activations and splits its batches so that its fp32 logits "
            f"stay under {EVAL_LOGITS_BYTES / 2**20:,.0f} MiB (minigpt.train.EVAL_LOGITS_BYTES).")


def run(args: argparse.Namespace) -> int:
    ranks = parse_ranks(args.rank)
    if args.base is not None and not args.base.is_dir():
        raise InputError(f"{args.base}: no such model folder (--base takes a folder; --config a config.json)")
    config = args.config if args.config is not None else args.base
    if config is not None:
        if args.tokenizer is not None:
            raise InputError("--tokenizer applies to the MiniGPT presets, not to --config or --base")
        shape = load_config_shape(config)
        seq_len, note = _window(config, args.seq_len)
    else:
        name = args.preset or "minigpt"
        if args.tokenizer is not None and name not in MINIGPT_SIZES:
            raise InputError(f"--tokenizer applies to the MiniGPT presets ({', '.join(MINIGPT_SIZES)}), not {name}")
        vocab = minigpt_vocab(args.tokenizer).size if name in MINIGPT_SIZES else None
        shape = preset_shape(name, vocab)
        context = preset_context(name)
        if args.seq_len is not None and args.seq_len > context:
            raise InputError(f"--seq-len {args.seq_len} exceeds the context of {context} tokens of preset {name}")
        seq_len, note = args.seq_len or min(MemoryConfig.seq_len, context), None
    activations = args.activations or best_activation_model(shape)
    for flag, given in (("--grad-checkpoint", args.grad_checkpoint), ("--counted-targets", args.counted_targets),
                        ("--grad-accum", args.grad_accum > 1),
                        ("--data", args.data), ("--dropout", args.dropout), ("--model-dropout", args.model_dropout)):
        if given and activations != "exact":
            if args.activations:
                raise InputError(f"{flag} needs --activations exact, got --activations {args.activations}")
            raise InputError(f"{flag} needs the exact activation model, which {shape.family} does not have yet")
    # finetune's batch size when planning its data, else the seed's
    batch_size = args.batch_size or (default_train_config().batch_size if args.data else MemoryConfig.batch_size)
    batch, data_note = data_batch(args, batch_size)
    counted = args.counted_targets
    if batch is not None:
        seq_len, counted = batch.seq_len, batch.counted
    if args.full_precision == "fp32" and args.master_copy != MemoryConfig.master_copy:
        raise InputError("--master-copy applies to --full-precision mixed (plain fp32 keeps no master copy)")
    cfg = MemoryConfig(batch_size=batch_size, seq_len=seq_len, double_quant=args.double_quant,
                       full_precision=args.full_precision, activations=activations, quantize=args.quantize,
                       master_copy=args.master_copy, grad_checkpoint=args.grad_checkpoint, counted_targets=counted,
                       model_dropout=args.model_dropout or 0.0, lora_dropout=args.dropout,
                       grad_accum=args.grad_accum)
    regimes = default_regimes(ranks)
    result = plan(shape, regimes, args.target or ALL_LINEAR, cfg)
    targets = ",".join(args.target) if args.target else ALL_LINEAR
    finetune_run = None
    if args.base is not None and note is None:  # a model finetune would refuse has no run to plan (noted already)
        try:
            finetune_run = finetune_plan(args.base, regimes, targets, batch_size, seq_len, args.grad_checkpoint,
                                         counted, lora_dropout=args.dropout, model_dropout=args.model_dropout,
                                         grad_accum=args.grad_accum)
        except InputError as e:  # no weights or damaged headers; GPT-2's own Linear names (finetune trains MiniGPT's)
            note = f"the run finetune makes from this folder is not planned: {e}"
    if args.json:
        data = {"data": {"source": args.data, **asdict(batch)}} if batch is not None else {}
        batch_json = {"batch_size": batch_size, "seq_len": seq_len, "counted_targets": counted or batch_size * seq_len,
                      "grad_accum": args.grad_accum}
        settings = {"targets": targets, "quantize": args.quantize, "double_quant": args.double_quant,
                    "full_precision": args.full_precision, "master_copy": args.master_copy,
                    "activations": activations, "grad_checkpoint": args.grad_checkpoint, "alpha": args.alpha,
                    "lora_dropout": args.dropout, "model_dropout": args.model_dropout}  # what the plan was made with
        print(json.dumps({**result.to_dict(), "settings": settings, "batch": batch_json, **data,
                          **({"finetune_cpu": finetune_run} if finetune_run else {})}, indent=2))
    else:
        print(describe(result, args.alpha))
        if batch is not None:
            print(describe_batch(batch, args.data))
        print()
        print(regime_table(result))
        if finetune_run:
            print()
            print(finetune_table(finetune_run, from_data=batch is not None,
                                 dropout_from="--model-dropout" if args.model_dropout is not None else "config.json"))
    for line in (note, data_note):  # after the plan, which may still refuse the model for a reason of its own
        if line:
            print(f"note: {line}", file=sys.stderr)
    return 0

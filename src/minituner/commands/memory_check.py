"""minituner memory-check: the planner's prediction beside the measured memory of real training steps."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.device import DEVICES, resolve_device
from minigpt.errors import InputError
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT

from ..base_model import model_config
from ..lora import ALL_LINEAR
from ..memory.check import REGIMES, CheckConfig, describe, format_table, load_model_folder, memory_check
from ..planner import minigpt_vocab
from ..planner.presets import MINIGPT_SIZES
from ._common import add_precision_arguments, positive_float, positive_int, seed

HELP = ("build a model, train a few steps and print the planner's memory prediction beside the measurement "
        "(weights, grads, optimizer, activations, peak) with the error of each")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=tuple(MINIGPT_SIZES), help="MiniGPT size, random weights (default minigpt)")
    src.add_argument("--config", type=Path,
                     help="config.json (or its folder) of a Hugging Face gpt2, llama, mistral or qwen2 model or a "
                          "MiniGPT base; random weights")
    src.add_argument("--base", type=Path, help="model folder (minituner base, or Hugging Face gpt2, llama, mistral "
                                               "or qwen2), read as finetune reads it: fp32 for --regime full, the "
                                               "checkpoint's dtype for lora and qlora")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json giving a --preset its vocab_size")
    d = CheckConfig()
    p.add_argument("--regime", choices=REGIMES, default=d.regime, help="what trains (default %(default)s)")
    p.add_argument("--rank", type=positive_int, help=f"LoRA rank (default {d.rank}; lora and qlora)")
    p.add_argument("--alpha", type=positive_float, default=d.alpha, help="lora_alpha (default %(default)s)")
    p.add_argument("--target", default=ALL_LINEAR, help="LoRA targets, e.g. q_proj,v_proj (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len,
                   help="tokens per sequence, at most the model's context (default %(default)s)")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, metavar="N",
                   help="batches per step, their gradients adding up, as finetune's --grad-accum (default "
                        "%(default)s)")
    p.add_argument("--counted-targets", type=positive_int, metavar="N",
                   help="targets per batch that count in the loss, at most batch x seq (default: all); the first "
                        "positions of the batch get -100, as an instruction batch's prompts and padding do")
    p.add_argument("--dropout", type=float, default=d.lora_dropout, metavar="P",
                   help="dropout on the LoRA path's input, as finetune's --dropout (default %(default)s)")
    p.add_argument("--model-dropout", type=float, metavar="P",
                   help="the model's own dropout (attention, residual, embeddings; MiniGPT and GPT-2) in place of its "
                        "config's (default: with --base the config's, as finetune trains it: GPT-2's 0.1; else 0)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="training steps (default %(default)s)")
    p.add_argument("--seed", type=seed, default=d.seed, help="seed of the random token batches (default %(default)s)")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda if available, else cpu")
    add_precision_arguments(p, d.precision)
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each block in backward (torch.utils.checkpoint): less activation memory")
    p.add_argument("--default-allocator", action="store_true",
                   help="CPU: leave glibc's mmap threshold as it is (by default memory-check pins it so that freed "
                        "tensors leave the resident set; unpinned, glibc keeps some and the peak includes them; the "
                        "heap trims that finetune makes during each forward run either way)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"predicted": {bucket: bytes}, "measured": {...}, "error": {bucket: '
                        'relative error}, "details": {...}} over weights, grads, optimizer, activations, peak')


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.tokenizer is not None and (args.config or args.base):
        raise InputError("--tokenizer applies to --preset, not to --config or --base")
    if args.base is not None:
        name = str(args.base)
        build = lambda: load_model_folder(args.base, device, args.regime)  # noqa: E731
    else:
        if args.config is not None:
            cfg, name = model_config(args.config), str(args.config)
        else:
            name = args.preset or "minigpt"
            cfg = GPTConfig(vocab_size=minigpt_vocab(args.tokenizer).size, **MINIGPT_SIZES[name])

        def build() -> MiniGPT | Decoder:
            with device:
                return Decoder(cfg) if isinstance(cfg, DecoderConfig) else MiniGPT(cfg)

    if args.regime == "full" and args.rank is not None:  # (a loop over regimes may pass it to each: a note)
        print("note: --rank applies to --regime lora and qlora; full fine-tuning has none", file=sys.stderr)
    check = CheckConfig(regime=args.regime, rank=args.rank or CheckConfig().rank, alpha=args.alpha,
                        targets=args.target,
                        batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
                        steps=args.steps, seed=args.seed,
                        precision=args.precision, allow_slow_bf16=args.allow_slow_bf16,
                        grad_checkpoint=args.grad_checkpoint, counted_targets=args.counted_targets,
                        model_dropout=args.model_dropout if args.model_dropout is not None or args.base else 0.0,
                        lora_dropout=args.dropout,
                        pin_allocator=not args.default_allocator)
    result = memory_check(build, check, device, name)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(describe(result))
        print()
        print(format_table(result))
    return 0

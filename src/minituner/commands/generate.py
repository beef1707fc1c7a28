"""minituner generate: sample text from a base model (optionally with a LoRA adapter)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from minigpt.errors import InputError

from ..base_model import load_base, load_tokenizer
from ._common import positive_int

HELP = ("print samples from a base model folder (minituner base, or Hugging Face gpt2/llama/mistral/qwen2 with its "
        "tokenizer; sampling stops at the eos id(s) of generation_config.json or config.json)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, default=Path("artifacts/base"))
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=positive_int, default=200)
    p.add_argument("--num-samples", type=positive_int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_base(args.base)
    if tokenizer is None:
        raise InputError(load_tokenizer(args.base, model.config.vocab_size)[1])
    if not args.prompt:
        raise InputError("--prompt is empty")
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.tensor([tokenizer.encode(args.prompt)] * args.num_samples)
    eos = getattr(tokenizer, "eos_ids", None)  # a Hugging Face folder's end-of-sequence id(s)
    out = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen,
                         eos_id=eos)
    for i, row in enumerate(out):
        print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(row.tolist()))
    return 0

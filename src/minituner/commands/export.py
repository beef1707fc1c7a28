"""minituner export: merge an adapter into its base and write a Hugging Face folder (transformers, vLLM)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..export import export_adapter

HELP = ("merge a LoRA or QLoRA adapter into its base and write a Hugging Face folder: config.json, safetensors "
        "shards of at most 5 GB, the tokenizer files (a MiniGPT base is written as GPT-2)")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, required=True, help="the base folder the adapter was trained on")
    p.add_argument("--adapter", type=Path, required=True,
                   help="a finetune run folder, an adapter .safetensors file or a PEFT adapter folder")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (atomically)")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the written weights (default: the base checkpoint's)")
    p.add_argument("--quant-scheme", default="auto",
                   help="QLoRA: merge onto the base with the adapter's targets quantized by this scheme, then "
                        "dequantized, as PEFT does; 'auto' (default): the scheme the run's manifest.json records; "
                        "'none': onto the float base")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (once the new one is complete)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="merge even when --base's weights differ from those the run's manifest records (e.g. the "
                        "same model converted to another dtype)")


def run(args: argparse.Namespace) -> int:
    scheme = None if args.quant_scheme.lower() == "none" else args.quant_scheme
    export_adapter(args.base, args.adapter, args.out, DTYPES.get(args.dtype), scheme, args.overwrite,
                   args.allow_other_base)
    print(f"wrote {args.out}/")
    return 0

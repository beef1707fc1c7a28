"""minituner export: merge an adapter into its base and write a Hugging Face folder (transformers, vLLM)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..export import export_adapter
from ._common import add_adapter_base_arguments, quant_scheme

HELP = ("merge a LoRA or QLoRA adapter into its base and write a Hugging Face folder: config.json, safetensors "
        "shards of at most 5 GB, the tokenizer files (a MiniGPT base is written as GPT-2)")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, required=True, help="the base folder the adapter was trained on")
    p.add_argument("--adapter", type=Path, required=True,
                   help="a finetune run folder, an adapter .safetensors file or a PEFT adapter folder")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (atomically)")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the written weights (default: the base checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (once the new one is complete)")
    add_adapter_base_arguments(p, "merge")


def run(args: argparse.Namespace) -> int:
    export_adapter(args.base, args.adapter, args.out, DTYPES.get(args.dtype), quant_scheme(args), args.overwrite,
                   args.allow_other_base)
    print(f"wrote {args.out}/")
    return 0

"""minituner pretrain: train the base MiniGPT on the built-in Python docs (or --data)."""
from __future__ import annotations

import argparse
from pathlib import Path

from minigpt.base_folder import MANIFEST
from minigpt.errors import InputError
from minigpt.io import read_json
from minigpt.pretrain import DEFAULT_DATA, pretrain
from minigpt.train import TrainConfig

from ..adapter_io import ADAPTER_FILE
from ..finetune import PEFT_DIR
from ._common import add_run_arguments, checkpoint_options, positive_float, positive_int, seed

HELP = "pretrain the base MiniGPT and write config.json, model.safetensors, tokenizer.json, manifest.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--data", default=DEFAULT_DATA, help="text file or folder, or builtin:NAME (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("artifacts/base"),
                   help="base folder to write (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate of AdamW (default %(default)s)")
    p.add_argument("--seed", type=seed, default=d.seed, help="seed of the init and data order (default %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=128, help="context in characters (default %(default)s)")
    p.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks (default %(default)s)")
    p.add_argument("--n-head", type=positive_int, default=4,
                   help="attention heads; must divide --d-model (default %(default)s)")
    p.add_argument("--d-model", type=positive_int, default=64,
                   help="width of the residual stream (default %(default)s)")
    add_run_arguments(p, "base")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the log lines stay)")


def run(args: argparse.Namespace) -> int:
    if args.overwrite and args.out.is_dir():
        held = [name for name in (ADAPTER_FILE, PEFT_DIR) if (args.out / name).exists()] + (
            [MANIFEST] if "method" in ((read_json(args.out / MANIFEST).get("config") or {})
                                       if (args.out / MANIFEST).is_file() else {}) else [])
        if held:  # pretrain replaces a pretraining run's files only: the adapter, a full fine-tune's tokenizer
            # files and template would stay beside the new base
            raise InputError(f"{args.out} holds a finetune run ({held[0]}); pretrain --overwrite replaces only a "
                             "pretraining run: choose another --out, or remove that run first")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      eval_every=max(1, min(250, args.steps)), **checkpoint_options(args))
    overrides = {"block_size": args.block_size, "n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model}
    pretrain(args.out, args.data, overrides, cfg, progress=not args.no_progress, overwrite=args.overwrite,
             resume=args.resume)
    print(f"wrote {args.out}/")
    return 0

"""Argument helpers shared by subcommands."""
from __future__ import annotations

import argparse
from pathlib import Path

from minigpt.device import PRECISIONS
from minigpt.errors import InputError

from ..qlora import check_scheme
from ..sft import FORMATS, Columns, DataSelection, parse_columns, parse_data_splits
from ..sft.formats import FIELDS, SplitNames
from ..sft.examples import OVERLONG

DEFAULT_CHECKPOINT_EVERY = 100  # steps between resumable checkpoints on the command line (the library default is none)


def _integer(text: str, low: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def columns(text: str) -> Columns:
    """--columns FIELD=COLUMN,...: the data set's columns that hold the fields the shapes read."""
    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--columns ")) from None


def data_splits(text: str) -> SplitNames:
    """--data-split SPLIT=NAME,...: the data set's splits to read as train, val and test."""
    try:
        return parse_data_splits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--data-split ")) from None


def add_selection_arguments(p: argparse.ArgumentParser, from_run: bool = False) -> None:
    """--data-config, --data-split and --columns: which records of a data set to read, under which names
    (`from_run`: eval, whose --adapter run's flags are the defaults for the data it trained on)."""
    run = "; on the data an --adapter run trained on, the run's" if from_run else ""
    p.add_argument("--data-config", metavar="NAME",
                   help="a data set folder whose dataset card (README.md) declares configs: the config (subset) to "
                        f"read (default: the one datasets.load_dataset reads unnamed{run})")
    p.add_argument("--data-split", type=data_splits, default=(), metavar="SPLIT=NAME[,...]",
                   help="read the data set's splits named otherwise as train, val and test, e.g. train=train_sft,"
                        f"val=test_sft (the others are not read; default: train, validation and test by name{run})")
    p.add_argument("--columns", type=columns, default=(), metavar="FIELD=COLUMN[,...]",
                   help="read these columns of the data set as the fields a shape reads, e.g. prompt=question,"
                        f"completion=answer (fields: {', '.join(FIELDS)}{run})")


def data_selection(args: argparse.Namespace, default: DataSelection = DataSelection()) -> DataSelection:
    """The DataSelection the flags of add_selection_arguments give, each flag not given taken from `default`."""
    return DataSelection(args.data_config if args.data_config is not None else default.config,
                         args.data_split or default.splits, args.columns or default.columns)


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


FLOAT32_MAX = 3.4028234663852886e38  # a learning rate or scale beyond it overflows the optimizer's float32 tensors
SEED_RANGE = (-2**63, 2**63 - 1)  # what torch.manual_seed takes


def _finite_float(text: str, zero_allowed: bool) -> float:
    what = "a finite number >= 0" if zero_allowed else "a positive finite number"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= 0 if zero_allowed else value > 0) or value > FLOAT32_MAX:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"expected {what} (at most {FLOAT32_MAX:.4g}), got {text}")
    return value


def seed(text: str) -> int:
    """A seed torch takes: an integer of 64 bits."""
    low, high = SEED_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected a seed between {low} and {high}, got {value}")
    return value


def text(value: str) -> str:
    """A text argument: a terminal that is not UTF-8 hands Python bytes it cannot decode (lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{value!a} holds bytes that are not UTF-8 text (is the terminal "
                                         "set to UTF-8?)") from None
    return value


def positive_float(text: str) -> float:
    return _finite_float(text, zero_allowed=False)


def non_negative_float(text: str) -> float:
    return _finite_float(text, zero_allowed=True)


def add_run_arguments(p: argparse.ArgumentParser, what: str = "run") -> None:
    """--overwrite or --resume, and the checkpoint and non-finite options of a training command."""
    again = p.add_mutually_exclusive_group()
    again.add_argument("--overwrite", action="store_true", help=f"replace a {what} already in --out")
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its newest checkpoint (same flags; bit-identical on CPU)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=DEFAULT_CHECKPOINT_EVERY, metavar="N",
                   help="write a resumable checkpoint to --out/checkpoints every N steps and at the end; 0: none "
                        "(default %(default)s)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, metavar="K",
                   help="keep the newest K checkpoints (default %(default)s)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradients are NaN/inf instead of stopping the run")


def checkpoint_options(args: argparse.Namespace) -> dict:
    """The TrainConfig fields set by add_run_arguments."""
    return {"checkpoint_every": args.checkpoint_every, "keep_checkpoints": args.keep_checkpoints,
            "skip_nonfinite": args.skip_nonfinite}


def add_adapter_base_arguments(p: argparse.ArgumentParser, verb: str = "use") -> None:
    """--quant-scheme and --allow-other-base: how a command puts --adapter on --base (export merges, eval and
    generate use it)."""
    p.add_argument("--quant-scheme", metavar="auto|none|SCHEME",
                   help=f"a QLoRA adapter: {verb} it on the base with its targets quantized by this scheme as they are "
                        "read, as its run trained it (export: then dequantized and merged, as PEFT merges); auto "
                        "(default): the scheme the run's manifest.json (or its adapter file) records; none: the float "
                        "base")
    p.add_argument("--allow-other-base", action="store_true",
                   help=f"{verb} the adapter even when --base's weights differ from those its run's manifest records "
                        "(e.g. the same model converted to another dtype)")


def quant_scheme(args: argparse.Namespace) -> str | None:
    """--quant-scheme as load_trained takes it ("auto", None for none, or a scheme's name), checked before anything
    is read; it and --allow-other-base are refused without --adapter, which they are about."""
    given = args.quant_scheme
    if args.adapter is None and (given is not None or args.allow_other_base):
        raise InputError("--quant-scheme and --allow-other-base apply to an --adapter")
    word = "auto" if given is None else given.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    try:
        return check_scheme(word)  # a scheme's name in any case, as auto and none
    except InputError as e:
        raise InputError(f"--quant-scheme {given!r}: {e}; or auto, none") from None


PRECISION_ALIASES = {"bf16-autocast": "bf16"}  # the old CUDA flag: the same bf16 path now


def _precision(text: str) -> str:
    return PRECISION_ALIASES.get(text, text)


def add_precision_arguments(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    """--precision {fp32,bf16} and --allow-slow-bf16, for commands that build a model to train."""
    p.add_argument("--precision", type=_precision, choices=PRECISIONS, default=default,
                   help="fp32, or bf16: the frozen base stored and multiplied in bf16; LoRA masters, norms, softmax, "
                        "loss, grads and AdamW stay fp32 (LoRA/QLoRA; CUDA, or a CPU with avx512_bf16/amx_bf16). "
                        "bf16-autocast is accepted as the old name of bf16 (default %(default)s)")
    p.add_argument("--allow-slow-bf16", action="store_true",
                   help="run --precision bf16 on a CPU without bf16 units (slower than fp32) instead of refusing")


def add_inference_precision_arguments(p: argparse.ArgumentParser, auto: str, cuda: bool = True) -> None:
    """--precision {auto,fp32,bf16} and --allow-slow-bf16 for a command that runs a model without training it;
    `auto` says what auto picks; `cuda`: the command runs on CUDA too."""
    p.add_argument("--precision", type=_precision, choices=("auto", *PRECISIONS), default="auto",
                   help=f"what the model computes in; auto (default): {auto}; bf16 only where the CPU has bf16 "
                        f"units (avx512_bf16/amx_bf16){' or on CUDA' if cuda else ''}")
    p.add_argument("--allow-slow-bf16", action="store_true",
                   help="--precision bf16 on a CPU without bf16 units (slower than fp32) instead of refusing")


def add_sft_arguments(p: argparse.ArgumentParser) -> None:
    """--format, --train-on-inputs and --overlong: how instruction data is read (finetune, and count --data)."""
    p.add_argument("--format", choices=FORMATS,
                   help="a data file's shape (default: recognised per file from its fields)")
    add_selection_arguments(p)
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template to render conversations with, in place of the base's (or the default "
                        "'User: ... Assistant: ...' where it has none); the run keeps it as chat_template.jinja")
    p.add_argument("--train-on-inputs", action="store_true",
                   help="instruction data: count the prompt, system and user tokens in the loss too "
                        "(default: only completions and assistant turns, with their EOS)")
    p.add_argument("--overlong", choices=OVERLONG, default="truncate",
                   help="instruction data: an example longer than the context is truncated (its start kept) or "
                        "dropped; the count is reported either way (default %(default)s)")

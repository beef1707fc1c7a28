"""Argument helpers shared by subcommands."""
from __future__ import annotations

import argparse
from pathlib import Path

from minigpt.errors import InputError


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def prepare_out_dir(out: Path, marker: str, overwrite: bool, resume: bool = False) -> None:
    """Refuse to write into a folder that already holds a run, unless told to overwrite or resume."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    if out.is_dir() and (out / marker).exists() and not (overwrite or resume):
        raise InputError(f"{out} already holds a run ({marker}); pass --overwrite to replace it or --resume")

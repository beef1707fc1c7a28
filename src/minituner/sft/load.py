"""From ``--data`` to tokenized train and val examples: the few calls a command needs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import InputError

from .builtin import BUILTIN_SFT, builtin_records
from .examples import Example, SFTConfig, SFTStats, tokenize_records
from .files import is_structured, read_records
from .formats import SPLITS, DataSelection, Record, split_records
from .templates import ChatTemplate

BUILTIN_PREFIX = "builtin:"


def is_sft_source(source: str | Path) -> bool:
    """True for a built-in instruction set or a .jsonl/.json/.parquet/.arrow file or folder; False for plain text."""
    s = str(source)
    if s.startswith(BUILTIN_PREFIX):
        return s[len(BUILTIN_PREFIX):] in BUILTIN_SFT
    return is_structured(s)


def plain_text_only(source: str, fmt: str | None, template_file: Path | None,
                    selection: DataSelection = DataSelection()) -> None:
    """Refuse the instruction-data options for plain text, which has neither records nor chats."""
    flags = [flag for flag, given in (("--format", fmt), ("--chat-template", template_file)) if given is not None]
    for flag in flags + selection.flags():
        raise InputError(f"{flag} applies to .jsonl/.json/.parquet/.arrow data, not to {source} (plain text)")


def load_records(source: str | Path, fmt: str | None = None, selection: DataSelection = DataSelection()
                 ) -> list[Record]:
    """``builtin:forecast-qa`` or a .jsonl/.json/.parquet/.arrow file or folder, every record in order (of a
    folder, the config and splits `selection` chooses)."""
    s = str(source)
    if s.startswith(BUILTIN_PREFIX):
        for flag in (["--format"] if fmt is not None else []) + selection.flags():
            raise InputError(f"{s} has a fixed format and splits; {flag} applies to files")
        return builtin_records(s[len(BUILTIN_PREFIX):])
    return read_records(Path(s), fmt, selection)


def split_names(records: list[Record]) -> list[str]:
    """The splits the records' files name (Record.split), in SPLITS order; [] when they name none."""
    named = {r.split for r in records}
    return [s for s in SPLITS if s in named]


def _splits(names: list[str]) -> str:
    return f"{' and '.join(names)} split{'s' if len(names) > 1 else ''}"


@dataclass
class SFTData:
    train: list[Example]
    val: list[Example]
    train_stats: SFTStats
    val_stats: SFTStats
    template: ChatTemplate


def prepare_sft(source: str | Path, tokenizer, template: ChatTemplate, block_size: int,
                cfg: SFTConfig | None = None, fmt: str | None = None, records: list[Record] | None = None) -> SFTData:
    """Read, split (split_records) and tokenize a data set; refuses an empty train or val split.

    `records` are the source's records when the caller has already read them (load_records)."""
    records = load_records(source, fmt) if records is None else records
    splits = split_records(records)
    if not splits["train"]:
        raise InputError(f"{source}: its files name the {_splits(split_names(records))} but no train split, which "
                         "training needs (a file or folder named train, or files that name no split)")
    train, train_stats = tokenize_records(splits["train"], tokenizer, template, block_size, cfg)
    val, val_stats = tokenize_records(splits["val"], tokenizer, template, block_size, cfg)
    for name, examples, stats in (("train", train, train_stats), ("val", val, val_stats)):
        if not examples:
            raise InputError(f"{source}: no {name} example fits block_size {block_size} ({stats.summary()})")
    return SFTData(train, val, train_stats, val_stats, template)


def prepare_eval(source: str | Path, tokenizer, template: ChatTemplate, block_size: int,
                 cfg: SFTConfig | None = None, fmt: str | None = None, split: str | None = None,
                 selection: DataSelection = DataSelection()) -> tuple[list[Example], SFTStats]:
    """Examples to evaluate on: every record of `source`, or one split of it (split_records: train, val, test)."""
    records = load_records(source, fmt, selection)
    if split is not None:
        if split not in SPLITS:
            raise InputError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        named = split_names(records)
        records = split_records(records)[split]
        if not records:
            given = f"its files name only the {_splits(named)}" if named else "it has too few records"
            raise InputError(f"{source}: no {split} split ({given})")
    examples, stats = tokenize_records(records, tokenizer, template, block_size, cfg)
    if not examples:
        raise InputError(f"{source}: no example to evaluate fits block_size {block_size} ({stats.summary()})")
    return examples, stats

"""A Hub data set's card: the configs (subsets) its README.md declares, and the files that make each split.

A snapshot of a Hugging Face data set holds a README.md whose YAML header may say which files make which split,
for one config or several (`datasets.load_dataset(folder, name)` reads them so):

    configs:
    - config_name: default
      default: true                 # the config load_dataset reads unnamed (else "default", or the only one)
      data_files:
      - split: train_sft
        path: data/train_sft-*      # glob patterns, relative to the folder (or to data_dir when one is given)
      - split: test_sft
        path: [data/test_sft-00000-of-00001.parquet]
    - config_name: ko
      data_dir: ko                  # no data_files: every data file under ko/, split by its name

`data_files` may also be one pattern or a list of them: all of it the train split. The card's split names are its
own (`train_sft`); `--data-split train=train_sft,val=test_sft` says which to train and validate on, and names
train, validation and test read as themselves (files.SPLIT_WORDS).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import InputError

CARD_NAMES = ("README.md", "readme.md", "README.MD")
SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")  # a split name datasets accepts in a card


@dataclass(frozen=True)
class CardConfig:
    """One config of a dataset card: its name, and either its splits' patterns or the folder that holds it."""

    name: str
    patterns: tuple[tuple[str, tuple[str, ...]], ...] | None  # (split, glob patterns) in card order; None: the
    # data files under data_dir (or the whole folder), split by their names
    data_dir: str | None = None  # where its patterns start, or the folder whose files it is
    default: bool = False  # `default: true` in the card


def card_path(folder: Path) -> Path | None:
    """The folder's dataset card (README.md), or None."""
    return next((folder / name for name in CARD_NAMES if (folder / name).is_file()), None)


def card_header(card: Path) -> dict:
    """The YAML between the card's first two '---' lines, as a dict ({} when it has none)."""
    try:
        text = card.read_text(encoding="utf-8").removeprefix("\ufeff")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{card}: not a readable dataset card ({e})") from None
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    if end is None:
        return {}
    import yaml

    try:
        header = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError as e:
        raise InputError(f"{card}: its YAML header does not parse ({str(e).splitlines()[0]})") from None
    return header if isinstance(header, dict) else {}


def _patterns(value, where: str) -> tuple[str, ...]:
    """One pattern or a list of them, as strings."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise InputError(f"{where}: a path is a glob pattern or a list of them, got {value!r}")
    return tuple(values)


def _config(entry, card: Path) -> CardConfig:
    if not isinstance(entry, dict) or not isinstance(entry.get("config_name"), str):
        raise InputError(f"{card}: each entry of configs needs a config_name, got {entry!r}")
    name, where = entry["config_name"], f"{card}: config {entry['config_name']!r}"
    data_dir = entry.get("data_dir")
    if data_dir is not None and (not isinstance(data_dir, str) or Path(data_dir).is_absolute()
                                 or ".." in Path(data_dir).parts):
        raise InputError(f"{where}: data_dir is a folder inside the data set, got {data_dir!r}")
    files = entry.get("data_files")
    if files is None:  # the data files under data_dir (or the whole folder), each in the split its name gives
        return CardConfig(name, None, data_dir, entry.get("default") is True)
    if isinstance(files, str) or (isinstance(files, list) and all(isinstance(f, str) for f in files)):
        patterns = (("train", _patterns(files, where)),)
    elif isinstance(files, list):
        splits = []
        for item in files:
            if not isinstance(item, dict) or set(item) != {"split", "path"}:
                raise InputError(f"{where}: each data_files entry is {{split: NAME, path: PATTERN(S)}}, got {item!r}")
            split = str(item["split"])
            if not SPLIT_NAME.match(split) or split in dict(splits):
                raise InputError(f"{where}: split {split!r} is not a split name or is named twice")
            splits.append((split, _patterns(item["path"], f"{where}, split {split!r}")))
        patterns = tuple(splits)
    else:
        raise InputError(f"{where}: data_files is a pattern, a list of them or a list of {{split, path}}, "
                         f"got {files!r}")
    return CardConfig(name, patterns, data_dir, entry.get("default") is True)


def card_configs(folder: Path) -> list[CardConfig]:
    """The configs the folder's dataset card declares, in card order ([] without a card or configs)."""
    card = card_path(folder)
    if card is None:
        return []
    configs = card_header(card).get("configs")
    if configs is None:
        return []
    if not isinstance(configs, list):
        raise InputError(f"{card}: configs is a list of {{config_name, data_files}}, got {configs!r}")
    found = [_config(entry, card) for entry in configs]
    names = [c.name for c in found]
    if len(set(names)) < len(names):
        raise InputError(f"{card}: a config is named twice ({', '.join(names)})")
    return found


def choose_config(configs: list[CardConfig], name: str | None, folder: Path) -> CardConfig | None:
    """The config `--data-config NAME` names, else the one datasets reads unnamed (marked default, named
    "default", or the only one); None where the card declares none."""
    names = ", ".join(c.name for c in configs)
    if name is not None:
        if not configs:
            raise InputError(f"--data-config {name}: {folder} has no dataset card (README.md) declaring configs")
        chosen = next((c for c in configs if c.name == name), None)
        if chosen is None:
            raise InputError(f"--data-config {name}: {folder}'s dataset card declares {names}")
        return chosen
    defaults = [c for c in configs if len(configs) == 1 or c.default or c.name == "default"]
    if len(defaults) > 1:
        raise InputError(f"{folder}: its dataset card marks several configs default ({', '.join(c.name for c in defaults)})"
                         "; choose one with --data-config NAME")
    if not defaults and configs:
        raise InputError(f"{folder}: its dataset card declares the configs {names}, subsets with data files of their "
                         "own; choose one with --data-config NAME")
    return defaults[0] if defaults else None


def _hidden(relative: Path) -> bool:
    """A path datasets skips: a part starting with '.' or '__' (caches, .git)."""
    return any(part.startswith((".", "__")) for part in relative.parts)


def pattern_files(folder: Path, config: CardConfig) -> list[tuple[str, list[Path]]]:
    """(card split, its files sorted) for each split of a config with data_files; a pattern that matches no file
    is refused, named."""
    base = folder / config.data_dir if config.data_dir else folder
    found = []
    for split, patterns in config.patterns or ():
        files: set[Path] = set()
        for pattern in patterns:
            pattern = pattern.removeprefix("./")
            if pattern.endswith("**"):  # datasets reads "data/**" as every file under data/
                pattern += "/*"
            if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
                raise InputError(f"{folder}: config {config.name!r}, split {split!r}: {pattern!r} is not a path "
                                 "inside the data set")
            matched = {p for p in base.glob(pattern) if p.is_file() and not _hidden(p.relative_to(base))}
            if not matched:
                raise InputError(f"{folder}: config {config.name!r}, split {split!r}: no file matches {pattern!r}"
                                 + (f" under {config.data_dir}/" if config.data_dir else ""))
            files |= matched
        found.append((split, sorted(files)))
    return found


def card_config_name(source: str | Path, name: str | None) -> str | None:
    """The name of the config a folder's records are read from (choose_config), or None (a file, a folder
    without card configs, a built-in set)."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    config = choose_config(card_configs(folder), name, folder)
    return None if config is None else config.name

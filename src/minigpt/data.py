"""Built-in corpora, user text, deterministic train/val/test splits and batch sampling.

Nothing is downloaded. ``python-docs`` (the pretraining domain) is the reference documentation
that every CPython ships as ``pydoc_data.topics``. ``forecasts`` (the fine-tuning domain) is a
seeded generator of terse weather bulletins: digits, units and place names in a fixed register that
the Python docs never use, so an adapter's gain on it is easy to see.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError

BUILTIN_PREFIX = "builtin:"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text", ""}


def python_docs_documents() -> list[str]:
    """The paragraphs of CPython's pydoc topics, in a fixed (sorted-topic) order."""
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    for key in sorted(topics):
        paragraphs.extend(p.strip("\n") for p in topics[key].split("\n\n") if p.strip())
    return paragraphs


_PLACES = ["Bergen", "Oslo", "Tromso", "Stavanger", "Aberdeen", "Shetland", "Faroe", "Malin",
           "Dover", "Plymouth", "Cork", "Galway", "Reykjavik", "Torshavn", "Kiel", "Gdansk"]
_WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
_SKY = ["clear", "fair", "cloudy", "overcast", "fog patches", "drizzle", "rain", "showers", "sleet", "snow"]
_TREND = ["rising slowly", "rising", "steady", "falling", "falling quickly"]
_SEA = ["smooth", "slight", "moderate", "rough", "very rough", "high"]
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def forecast_documents(n: int = 4000, seed: int = 28) -> list[str]:
    """n weather bulletins drawn from a seeded generator (identical on every machine)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        place, wind = rng.choice(_PLACES), rng.choice(_WINDS)
        force = rng.randint(1, 9)
        temp = rng.randint(-8, 24)
        docs.append(
            f"{place}, {rng.randint(1, 28)} {rng.choice(_MONTHS)}: wind {wind} {force}"
            f"{' to ' + str(force + 1) if rng.random() < 0.4 else ''}, {rng.choice(_SKY)}, "
            f"{temp} C, pressure {rng.randint(960, 1040)} hPa {rng.choice(_TREND)}. "
            f"Sea state {rng.choice(_SEA)}. Visibility {rng.choice(['good', 'moderate', 'poor'])}."
        )
    return docs


BUILTIN = {"python-docs": python_docs_documents, "forecasts": forecast_documents}
PRETRAIN_DATA = BUILTIN_PREFIX + "python-docs"  # what pretraining reads by default (and fine-tuning's base domain)
FINETUNE_DATA = BUILTIN_PREFIX + "forecasts"  # what fine-tuning reads by default: a domain the base never saw


# what marks a folder as a model or a training run, never data: a run of ours (its manifest beside its metrics), a
# model folder (config.json beside its weights), a PEFT adapter; any one pair present
NOT_DATA_MARKS = (("manifest.json", "metrics.jsonl"), ("config.json", "model.safetensors"),
                  ("config.json", "model.safetensors.index.json"), ("adapter_config.json", "adapter_model.safetensors"),
                  ("adapter_config.json", "adapter_model.bin"))


def visible_files(folder: Path) -> list[Path]:
    """The files under `folder`, recursively, sorted; none hidden or in a hidden folder (.git, .cache, a run's
    .replaced-run.*), which are never data."""
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def check_no_models_within(folder: Path, files: list[Path]) -> None:
    """Refuse a data folder whose files (``visible_files``) include a model or a training run (NOT_DATA_MARKS), in
    the folder itself or under it: read recursively, its files (a tokenizer's merges.txt, a model card,
    metrics.jsonl) would be taken for data."""
    held = set(files)
    for first, second in NOT_DATA_MARKS:
        mark = next((f for f in files if f.name == first and f.parent / second in held), None)
        if mark is not None:
            where = mark.parent.relative_to(folder)
            raise InputError(f"{folder}: {'the folder' if where == Path('.') else where} holds a model or a "
                             f"training run ({first}, {second}), not data; keep it outside the data folder or give "
                             "--data the data files")


def read_user_documents(path: Path) -> list[str]:
    """A text file, or every text file under a folder (``visible_files``; not a folder holding a model or a run),
    split into paragraphs."""
    if not path.exists():
        raise InputError(f"{path}: data file or folder not found")
    files = [path]
    if path.is_dir():
        listed = visible_files(path)
        check_no_models_within(path, listed)
        files = [p for p in listed if p.suffix.lower() in TEXT_SUFFIXES]
    docs: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{f}: not UTF-8 text") from None
        docs.extend(p.strip("\n") for p in text.split("\n\n") if p.strip())
    if not docs:
        raise InputError(f"{path}: no text found (empty data)")
    return docs


def load_documents(source: str | Path) -> list[str]:
    """``builtin:NAME`` or a path to the user's text file or folder."""
    s = str(source)
    if s.startswith(BUILTIN_PREFIX):
        name = s[len(BUILTIN_PREFIX):]
        if name not in BUILTIN:
            raise InputError(f"unknown built-in corpus {name!r}; valid: {sorted(BUILTIN)}")
        return BUILTIN[name]()
    return read_user_documents(Path(s))


@dataclass
class Splits:
    train: str
    val: str
    test: str


def split_documents(docs: list[str], period: int = 20) -> Splits:
    """Deterministic split: of every `period` documents, one goes to val and one to test (documents joined by a
    blank line, as paragraphs are read).

    With fewer than `period` documents, the joined text itself is split: its last two `period`-ths are val, then
    test, each cut moved to whitespace (``_cut_at_whitespace``: no word cut in two, nothing added).
    """
    if not docs or not any(d.strip() for d in docs):
        raise InputError("the data is empty")
    if len(docs) < period:
        text = "\n\n".join(docs)
        val_at = _cut_at_whitespace(text, len(text) * (period - 2) // period)
        test_at = max(val_at, _cut_at_whitespace(text, len(text) * (period - 1) // period))
        return Splits(train=text[:val_at], val=text[val_at:test_at], test=text[test_at:])
    parts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for i, d in enumerate(docs):
        r = i % period
        parts["val" if r == period - 2 else "test" if r == period - 1 else "train"].append(d)
    return Splits(**{k: "\n\n".join(v) + "\n\n" for k, v in parts.items()})


WHITESPACE = re.compile(r"\s")


def _cut_at_whitespace(text: str, at: int) -> int:
    """Where whitespace starts at or after `at`, else the last whitespace before it, else `at` (text with no
    whitespace, as Chinese or Japanese is written): a cut there splits no word."""
    found = WHITESPACE.search(text, at)
    if found:
        return found.start()
    before = max(text.rfind(c, 0, at) for c in " \t\n\r\f\v")
    return before if before > 0 else at


def encode_split(text: str, tokenizer, block_size: int, name: str) -> torch.Tensor:
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if ids.numel() < block_size + 2:
        raise InputError(f"the {name} split has {ids.numel()} tokens, fewer than block_size + 2 = {block_size + 2}")
    return ids


def sample_batch(data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator):
    """Random windows (nanoGPT's get_batch): inputs x and next-token targets y, each (B, T)."""
    ix = torch.randint(data.numel() - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[ix[:, None] + offsets]  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]


def eval_batches(data: torch.Tensor, batch_size: int, block_size: int, max_batches: int):
    """Fixed, non-overlapping windows from the start of a split: the same every call."""
    n = min((data.numel() - 1) // block_size, batch_size * max_batches)
    starts = torch.arange(n) * block_size
    offsets = torch.arange(block_size + 1)
    for i in range(0, n, batch_size):
        w = data[starts[i : i + batch_size, None] + offsets]
        yield w[:, :-1], w[:, 1:]


def unigram_entropy(ids: torch.Tensor, vocab_size: int) -> float:
    """Entropy (nats/token) of the empirical token distribution: the loss of a context-free model."""
    counts = torch.bincount(ids, minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())

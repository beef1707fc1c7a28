"""Where instruction data lives on disk, read into Records: ``.jsonl`` / ``.json`` files, ``.parquet`` and
``.arrow`` tables (what the Hugging Face Hub serves and ``datasets``' ``to_parquet`` / ``save_to_disk`` write),
or folders of them.

``formats`` says what one record may hold; this module finds the files, reads their records in order and names
the file and line (or row) of every mistake. In a folder, a file whose path names a split as Hugging Face
``datasets`` names them (``train-00000-of-00001.parquet``, ``test.jsonl``, ``validation/``, ``dev.json``) keeps
that split (``Record.split``; ``formats.split_records`` honours it).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from minigpt.errors import InputError

from .formats import SPLITS, Columns, Record, check_format, first_format, parse_record, renamed

JSON_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")  # read with pyarrow, a row a record
SUFFIXES = JSON_SUFFIXES + TABLE_SUFFIXES
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")  # what minigpt.data reads as plain text
# metadata, not records, in a folder of tables: datasets' save_to_disk writes the first three beside its .arrow
# files, older Hub snapshots the last beside their Parquet files
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json", "dataset_infos.json")
# a split's names in file and folder names, as datasets.data_files.SPLIT_KEYWORDS has them
SPLIT_KEYWORDS = {"train": ("train", "training"), "val": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
SPLIT_WORDS = {word: split for split, words in SPLIT_KEYWORDS.items() for word in words}
WORD_SEPARATORS = re.compile(r"[-._ 0-9]+")  # datasets' NON_WORDS_CHARS


def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at column {col})") from None


def _json_values(path: Path, text: str):
    """(line, value) for each record: the elements of a JSON array, or one JSON value per non-blank line."""
    stripped = text.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        decoder, i = json.JSONDecoder(), text.index("[") + 1
        while True:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i < len(text) and text[i] == "]":
                return
            line = text.count("\n", 0, i) + 1
            try:
                value, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{text.count(chr(10), 0, e.pos) + 1}: not valid JSON ({e.msg})") from None
            yield line, value
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i < len(text) and text[i] == ",":
                i += 1
            elif i >= len(text) or text[i] != "]":
                raise InputError(f"{path}:{text.count(chr(10), 0, i) + 1}: expected ',' or ']' in the JSON array")
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON strings may hold U+2028
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not valid JSON ({e.msg}); a .jsonl file holds one object per line, "
                                 "a .json file an array of objects") from None


def _check_unicode(obj, where: str) -> None:
    """A JSON \\ud800-style escape can make a string no UTF-8 encodes (a lone surrogate): refused, named."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: a string holds {e.object[e.start:e.end]!a}, half of a UTF-16 surrogate pair, "
                         "which is not text") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to be a record") from None


def _json_rows(path: Path):
    """(where, value) of each record of a .jsonl/.json file."""
    values = _json_values(path, _decode(path))
    while True:
        try:
            line, obj = next(values)
        except StopIteration:
            return
        except RecursionError:  # json's decoder recurses once per nesting level
            raise InputError(f"{path}: JSON nested too deeply to be a record") from None
        where = f"{path}:{line}"
        _check_unicode(obj, where)
        yield where, obj


def _batches(path: Path):
    """The record batches of a Parquet file or an Arrow IPC stream or file (datasets writes streams)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading {path.suffix} files needs pyarrow (pip install pyarrow)") from None
    try:
        if path.suffix.lower() == ".parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=1024)
            return
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                return
            yield from reader
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow"
        raise InputError(f"{path}: not a readable {kind} file ({str(e).splitlines()[0] if str(e) else e})") from None


def _table_rows(path: Path):
    """(where, row as a dict) of each row of a .parquet/.arrow table; `where` counts rows from 1."""
    n = 0
    for batch in _batches(path):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:
            raise InputError(f"{path}: row {n + 1} or one of the next {batch.num_rows - 1}: a string column holds "
                             "bytes that are not UTF-8") from None
        for row in rows:
            n += 1
            yield f"{path}:row {n}", row


def read_file(path: str | Path, fmt: str | None = None, split: str | None = None,
              columns: Columns = ()) -> list[Record]:
    """The records of one .jsonl, .json, .parquet or .arrow file; the shape comes from its first record unless
    `fmt` forces it; `split` tags them (Record.split); `columns` renames the file's columns to the fields the
    shapes read (formats.renamed)."""
    path = Path(path)
    check_format(fmt)
    records: list[Record] = []
    rows = _table_rows(path) if path.suffix.lower() in TABLE_SUFFIXES else _json_rows(path)
    for where, obj in rows:
        obj = renamed(obj, columns, where)
        if fmt is None:
            fmt = first_format(obj, where)
        record = parse_record(obj, fmt, where)
        records.append(record if split is None else replace(record, split=split))
    if not records:
        raise InputError(f"{path}: no records (empty data)")
    return records


def _listed(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _is_metadata(p: Path, tables: bool) -> bool:
    """datasets' metadata in a folder of tables, or a README beside the data (a Hub snapshot's dataset card)."""
    return (tables and p.name in DATASETS_METADATA) or (p.stem.lower() == "readme" and p.suffix in TEXT_SUFFIXES)


def split_named(relative: Path) -> str | None:
    """The split a data file's path (relative to the folder given) names, or None; folder names first, then the
    file's, whole words, case-sensitive, as datasets resolves them. A name that names two splits is refused."""
    for part in (*relative.parts[:-1], relative.stem):
        found = {SPLIT_WORDS[w] for w in WORD_SEPARATORS.split(part) if w in SPLIT_WORDS}
        if len(found) > 1:
            raise InputError(f"{relative}: '{part}' names two splits ({', '.join(sorted(found))}); rename it")
        if found:
            return found.pop()
    return None


def data_files(path: str | Path) -> list[tuple[Path, str | None]]:
    """(file, split its path names) for `path` itself, or for the data files under a folder (recursively, sorted,
    hidden ones skipped).

    Refused, as data is never skipped silently: a folder that also holds text files (a README excepted), and one
    where some files name a split and others do not.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: data file or folder not found")
    if path.is_file():
        return [(path, None)]
    listed = _listed(path)
    tables = any(p.suffix.lower() in TABLE_SUFFIXES for p in listed)
    listed = [p for p in listed if not _is_metadata(p, tables)]
    files = [p for p in listed if p.suffix.lower() in SUFFIXES]
    if not files:
        raise InputError(f"{path}: no .jsonl, .json, .parquet or .arrow files in the folder")
    text = [p for p in listed if p.suffix.lower() in TEXT_SUFFIXES]
    if text:
        raise InputError(f"{path}: the folder holds data files and text files ({text[0].name}); "
                         "give a folder of one kind")
    named = [(p, split_named(p.relative_to(path))) for p in files]
    unnamed = [p for p, split in named if split is None]
    if len(unnamed) < len(named) and unnamed:
        split, first = next((s, p) for p, s in named if s is not None)
        raise InputError(f"{path}: {first.relative_to(path)} is in the {split} split by its name, but "
                         f"{unnamed[0].relative_to(path)} names none of {', '.join(SPLITS)}; give one split's files "
                         "or rename them")
    return named


def is_structured(path: str | Path) -> bool:
    """True for a data file (.jsonl, .json, .parquet, .arrow) or a folder holding one: records for these
    readers, not plain text."""
    path = Path(path)
    if path.is_file():
        return path.suffix.lower() in SUFFIXES
    return path.is_dir() and any(p.suffix.lower() in SUFFIXES for p in _listed(path))


def read_records(path: str | Path, fmt: str | None = None, columns: Columns = ()) -> list[Record]:
    """Every record of a data file or folder, in file order (files sorted by path), tagged with the split their
    file names."""
    return [r for f, split in data_files(path) for r in read_file(f, fmt, split, columns)]

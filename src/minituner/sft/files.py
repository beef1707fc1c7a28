"""Where instruction data lives on disk, read into Records: ``.jsonl`` / ``.json`` and ``.csv`` / ``.tsv`` files
(compressed with gzip, bzip2, xz or zstd or not), ``.parquet`` and ``.arrow`` tables (what the Hugging Face Hub
serves and ``datasets``' ``to_parquet`` / ``save_to_disk`` write), or folders of them.

``formats`` says what one record may hold; this module finds the files, reads their records in order and names
the file and line (or row) of every mistake. In a folder, a file whose path names a split as Hugging Face
``datasets`` names them (``train-00000-of-00001.parquet``, ``test.jsonl``, ``validation/``, ``dev.json``) keeps
that split (``Record.split``; ``formats.split_records`` honours it). A folder whose dataset card declares configs
(``dataset_card``) is read as its config says: the files each split's patterns match.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import re
import zlib
from dataclasses import replace
from pathlib import Path

from minigpt.data import check_no_models_within, visible_files
from minigpt.errors import InputError

from .dataset_card import card_configs, choose_config, pattern_files
from .formats import (SPLITS, Columns, DataSelection, Record, SplitNames, check_format, first_format, parse_record,
                      renamed)

JSON_SUFFIXES = (".jsonl", ".json")
CSV_SUFFIXES = (".csv", ".tsv")  # read with the csv module: every cell a string, as written
TABLE_SUFFIXES = (".parquet", ".arrow")  # read with pyarrow, a row a record
COMPRESSIONS = {".gz": gzip, ".bz2": bz2, ".xz": lzma, ".zst": None}  # around a JSON or CSV file, as datasets
# reads them; .zst (the Hub's .jsonl.zst shards: SlimPajama, Dolma) through zstandard, as Python has zstd only from 3.14
ZSTD_MAX_WINDOW = 1 << 31  # the largest window zstd writes (--long=31)
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")  # what minigpt.data reads as plain text
UNREAD_SUFFIXES = (".zip", ".tar", ".tgz", ".7z", ".lz4", ".xlsx", ".xls", ".feather", ".pkl", ".pickle",
                   ".h5", ".hdf5")  # data this reader does not read: a folder holding one is refused, not skipped
# metadata, not records: datasets' save_to_disk writes the first three beside its .arrow files (state.json lists
# them), older Hub snapshots the last
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json", "dataset_infos.json")
# a Hub shard's name: its split as datasets reads it (data/{split}-00000-of-00002.parquet), exactly
SHARD_NAME = re.compile(r"^(?P<split>\w+(?:\.\w+)*)-\d{5}-of-\d{5}(?:-[^./]*)?\.")  # -<hash> in older pushes
# a split's names in file and folder names, as datasets.data_files.SPLIT_KEYWORDS has them
SPLIT_KEYWORDS = {"train": ("train", "training"), "val": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
SPLIT_WORDS = {word: split for split, words in SPLIT_KEYWORDS.items() for word in words}
WORD_SEPARATORS = re.compile(r"[-._ 0-9]+")  # datasets' NON_WORDS_CHARS


def data_kind(path: Path) -> str | None:
    """"json", "csv" or "table" for a data file this module reads (by its suffixes), else None."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if not suffixes:
        return None
    inner = suffixes[0] if len(suffixes) == 2 and suffixes[-1] in COMPRESSIONS else suffixes[-1]
    if inner in JSON_SUFFIXES:
        return "json"
    if inner in CSV_SUFFIXES:
        return "csv"
    return "table" if suffixes[-1] in TABLE_SUFFIXES else None


def is_unread(path: Path) -> bool:
    """Data this module does not read: a .zip, .tar, .xlsx... (UNREAD_SUFFIXES), or a compressed file holding
    anything but JSON or CSV (.parquet.zst, .tar.gz, .txt.gz, a bare .zst)."""
    suffix = path.suffix.lower()
    return suffix in UNREAD_SUFFIXES or (suffix in COMPRESSIONS and data_kind(path) is None)


def _inner_suffix(path: Path) -> str:
    """The suffix under a compression's (.jsonl for chats.jsonl.gz)."""
    return Path(path.stem).suffix.lower() if path.suffix.lower() in COMPRESSIONS else path.suffix.lower()


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when its suffix names gzip, bzip2, xz or zstd."""
    suffix = path.suffix.lower()
    if suffix not in COMPRESSIONS:
        return path.read_bytes()
    if suffix == ".zst":
        return _zstd_bytes(path)
    try:
        with COMPRESSIONS[suffix].open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
        raise InputError(f"{path}: not a readable {path.suffix[1:]} file ({e})") from None


def _zstd_bytes(path: Path) -> bytes:
    """A .zst file's bytes, frame after frame; a frame cut short is refused (zstandard's stream reader would
    return what it has)."""
    try:
        import zstandard
    except ImportError:
        raise InputError(f"{path}: reading .zst files needs zstandard (pip install zstandard)") from None
    data, out = path.read_bytes(), []
    try:
        while data:  # windows up to 2 GiB, as `zstd --long=31` writes them (zstandard's default stops at 128 MiB)
            frame = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj()
            out.append(frame.decompress(data))
            if not frame.eof:
                raise zstandard.ZstdError("the last frame is cut short")
            data = frame.unused_data
    except zstandard.ZstdError as e:
        raise InputError(f"{path}: not a readable zst file ({e})") from None
    return b"".join(out)


def _decode(path: Path) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at column {col})") from None


def _past_space(text: str, i: int) -> int:
    """The index of the first character at or after i that is not JSON's whitespace."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _check_nothing_after(path: Path, text: str, i: int) -> None:
    """InputError where anything but whitespace follows a .json file's array (a second array, an object): json.load
    refuses it too, and records past the first array would otherwise go unread without a word."""
    i = _past_space(text, i)
    if i < len(text):
        raise InputError(f"{path}:{text.count(chr(10), 0, i) + 1}: more after the JSON array's closing ']' "
                         "(a .json file holds one array of objects; one object per line is a .jsonl file)")


def _json_values(path: Path, text: str):
    """(line, value) for each record: the elements of a JSON array, or one JSON value per non-blank line."""
    stripped = text.lstrip()
    if _inner_suffix(path) == ".json" and stripped.startswith("["):
        decoder, i = json.JSONDecoder(), text.index("[") + 1
        while True:
            i = _past_space(text, i)
            if i < len(text) and text[i] == "]":
                _check_nothing_after(path, text, i + 1)
                return
            line = text.count("\n", 0, i) + 1
            try:
                value, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{text.count(chr(10), 0, e.pos) + 1}: not valid JSON ({e.msg})") from None
            yield line, value
            i = _past_space(text, i)
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


def _csv_rows(path: Path):
    """(where, row as a dict of strings) of each row of a .csv/.tsv file (its first line the column names)."""
    reader = csv.DictReader(io.StringIO(_decode(path), newline=""),
                            delimiter="\t" if _inner_suffix(path) == ".tsv" else ",", strict=True)
    start = 1  # the line the record being read starts on (line_num counts the lines read once a record is whole)
    try:
        twice = sorted({name for name in reader.fieldnames or [] if reader.fieldnames.count(name) > 1})
        if twice:  # DictReader would keep the last such column's cells under the name, silently
            raise InputError(f"{path}:1: the header names {twice[0]!r} twice")
        start = reader.line_num + 1
        for row in reader:
            if None in row:  # more cells than the header names
                raise InputError(f"{path}:{start}: {len(row) - 1 + len(row[None])} cells, the header names "
                                 f"{len(reader.fieldnames)}")
            yield f"{path}:{start}", row
            start = reader.line_num + 1
    except csv.Error as e:
        raise InputError(f"{path}:{start}: not valid CSV ({e})") from None


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
    """The records of one data file (.jsonl, .json, .csv, .tsv, compressed or not; .parquet, .arrow); the shape
    comes from its first record unless
    `fmt` forces it; `split` tags them (Record.split); `columns` renames the file's columns to the fields the
    shapes read (formats.renamed)."""
    path = Path(path)
    check_format(fmt)
    records: list[Record] = []
    rows = {"table": _table_rows, "csv": _csv_rows}.get(data_kind(path), _json_rows)(path)
    for where, obj in rows:
        obj = renamed(obj, columns, where)
        if fmt is None:
            fmt = first_format(obj, where)
        record = parse_record(obj, fmt, where)
        records.append(record if split is None else replace(record, split=split))
    if not records:
        raise InputError(f"{path}: no records (empty data)")
    return records


def _is_metadata(p: Path) -> bool:
    """datasets' metadata, or a README beside the data (a Hub snapshot's dataset card)."""
    return p.name in DATASETS_METADATA or (p.stem.lower() == "readme" and p.suffix.lower() in TEXT_SUFFIXES)


def _saved_arrow_files(folder: Path) -> set[str] | None:
    """The .arrow files a datasets save_to_disk folder holds (its state.json's _data_files), or None for another
    folder. Others beside them are datasets' caches of later map/filter calls, derived copies, not data."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        return {f["filename"] for f in state["_data_files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def split_named(relative: Path, in_data: bool = False) -> str | None:
    """The split a data file's path (relative to the folder given) names, or None, as datasets resolves it: a
    Hub shard's name in a snapshot's data/ folder (`in_data`: data/train_sft-00000-of-00002.parquet) exactly, as
    written (train_sft); else train, val or test, by folder names first, then the file's, by their whole words,
    case-sensitive. A name that names two splits is refused."""
    shard = SHARD_NAME.match(relative.name) if in_data else None
    if shard:
        return shard["split"]
    for part in (*relative.parts[:-1], relative.stem):
        found = {SPLIT_WORDS[w] for w in WORD_SEPARATORS.split(part) if w in SPLIT_WORDS}
        if len(found) > 1:
            raise InputError(f"{relative}: '{part}' names two splits ({', '.join(sorted(found))}); rename it")
        if found:
            return found.pop()
    return None


def data_files(path: str | Path, selection: DataSelection = DataSelection()) -> list[tuple[Path, str | None]]:
    """(file, split it is read as) for `path` itself, or for the data files of a folder: those its dataset card's
    config names (dataset_card: --data-config, or the config datasets reads unnamed), else the data files under it
    (recursively, sorted, hidden ones skipped; a save_to_disk folder's own .arrow files, not datasets' caches beside
    them), each in the split its path names.

    Refused, as data is never skipped silently: a folder that holds a model or a training run, itself or in a
    folder under it (``minigpt.data.check_no_models_within``), a folder that also holds text files (a README
    excepted) or data this module does not read (.zip, .tar, ...), one whose card declares several configs and none
    is chosen, a split named otherwise than train, validation or test unless --data-split says what it is, and a
    folder where some files name a split and others do not.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: data file or folder not found")
    if path.is_file():
        if selection.config is not None or selection.splits:
            raise InputError(f"--data-config and --data-split choose among a folder's configs and splits; {path} is "
                             "one file")
        if data_kind(path) is None:
            raise InputError(f"{path}: not a data file this reads (.jsonl, .json, .csv, .tsv, compressed .gz/.bz2/"
                             ".xz/.zst or not; .parquet, .arrow)")
        return [(path, None)]
    config = choose_config(card_configs(path), selection.config, path)
    if config is not None and config.patterns is not None:
        named = [(f, split) for split, files in pattern_files(path, config) for f in files]
        where = f"{path} (config {config.name!r} of its dataset card)"
    else:  # no card configs, or one that is a folder of files split by their names
        root = path / config.data_dir if config is not None and config.data_dir else path
        if not root.is_dir():
            raise InputError(f"{path}: config {config.name!r} of its dataset card names the folder {config.data_dir}, "
                             "which is not there")
        named = _named_files(root)
        where = str(path)
    return _as_our_splits(named, selection.splits, where, path)


def _named_files(path: Path) -> list[tuple[Path, str | None]]:
    """(file, the split its path names as written, or None) for the data files under a folder (not one holding a
    model or a run)."""
    every = visible_files(path)
    check_no_models_within(path, every)
    listed = [p for p in every if not _is_metadata(p)]
    saved = {folder: _saved_arrow_files(folder) for folder in {p.parent for p in listed}}
    files = [p for p in listed if data_kind(p) is not None
             and (saved[p.parent] is None or p.suffix.lower() != ".arrow" or p.name in saved[p.parent])]
    _check_kinds(path, listed, files)
    # datasets reads {split}-00000-of-00001 names exactly in a snapshot's data/ (given the snapshot or data/)
    data_dir = path / "data" if path.name != "data" else path
    named = [(p, split_named(p.relative_to(path), p.parent == data_dir and saved[p.parent] is None)) for p in files]
    unnamed = [p for p, split in named if split is None]
    if len(unnamed) < len(named) and unnamed:
        split, first = next((s, p) for p, s in named if s is not None)
        raise InputError(f"{path}: {first.relative_to(path)} is in the {SPLIT_WORDS.get(split, split)} split by its "
                         f"name, but {unnamed[0].relative_to(path)} names none of {', '.join(SPLITS)}; give one "
                         "split's files or rename them")
    return named


def _check_kinds(path: Path, listed: list[Path], files: list[Path]) -> None:
    """Refuse a folder holding data this does not read, no data, or text files beside the data."""
    unread = [p for p in listed if is_unread(p)]
    if unread:
        raise InputError(f"{path}: {unread[0].relative_to(path)} is data this does not read; convert it to .jsonl "
                         "or .parquet, or give --data the files it reads")
    if not files:
        raise InputError(f"{path}: no .jsonl, .json, .csv, .parquet or .arrow files in the folder")
    text = [p for p in listed if p.suffix.lower() in TEXT_SUFFIXES]
    if text:
        raise InputError(f"{path}: the folder holds data files and text files ({text[0].name}); "
                         "give a folder of one kind")


def _example_splits(names: list[str]) -> str:
    """An example --data-split for these split names: train= the first whose words name train (train_sft), val= the
    first naming val, else test (test_sft)."""
    def first(*ours: str) -> str | None:
        return next((n for o in ours for n in names
                     if any(SPLIT_WORDS.get(w) == o for w in WORD_SEPARATORS.split(n))), None)

    pairs = [(o, n) for o, n in (("train", first("train") or names[0]), ("val", first("val", "test"))) if n]
    return ",".join(f"{o}={n}" for o, n in pairs)


def _as_our_splits(named: list[tuple[Path, str | None]], splits: SplitNames, where: str, path: Path
                   ) -> list[tuple[Path, str | None]]:
    """The files whose split is read as train, val or test: with --data-split, the splits it names (the others are
    not read); without, each by its own name (SPLIT_WORDS: validation, dev... are val), a name that is none of
    them refused."""
    for f, _ in named:
        if data_kind(f) is None:
            kind = "data this does not read" if is_unread(f) else "not a data file this reads"
            raise InputError(f"{where}: {f.relative_to(path)} is {kind}; convert it to .jsonl or .parquet")
    theirs = list(dict.fromkeys(s for _, s in named if s is not None))
    if splits:
        # a file named by a split's word (validation.jsonl, dev/) is tagged with ours (val): either name finds it
        resolved = [(split, name if name in theirs else SPLIT_WORDS.get(name, name)) for split, name in splits]
        missing = [name for (_, name), (_, found) in zip(splits, resolved) if found not in theirs]
        if missing:
            has = f"its splits are {', '.join(theirs)}" if theirs else "its files name no split"
            raise InputError(f"--data-split: {where} has no split {missing[0]!r} ({has})")
        if len({found for _, found in resolved}) < len(resolved):  # val=validation,test=dev: both the files' val
            raise InputError(f"--data-split: {', '.join(n for _, n in splits)} name one split of {where} twice")
        ours = {name: split for split, name in resolved}
        return [(f, ours[s]) for f, s in named if s in ours]
    unknown = [s for s in theirs if s not in SPLIT_WORDS]
    if unknown:
        raise InputError(f"{where}: its split {unknown[0]!r} is none of train, validation or test (its splits: "
                         f"{', '.join(theirs)}); say which to read with --data-split, e.g. {_example_splits(theirs)}")
    by_ours: dict[str, list[str]] = {}
    for s in theirs:
        by_ours.setdefault(SPLIT_WORDS[s], []).append(s)
    twice = next((names for names in by_ours.values() if len(names) > 1), None)
    if twice:
        raise InputError(f"{where}: its splits {' and '.join(twice)} both read as {SPLIT_WORDS[twice[0]]}; say which "
                         f"to read with --data-split {SPLIT_WORDS[twice[0]]}={twice[0]}")
    return [(f, None if s is None else SPLIT_WORDS[s]) for f, s in named]


def is_structured(path: str | Path) -> bool:
    """True for a data file (.jsonl, .json, .csv, .tsv, .parquet, .arrow) or a folder holding one: records for
    these readers, not plain text."""
    path = Path(path)
    if path.is_file():
        return data_kind(path) is not None
    return path.is_dir() and any(data_kind(p) is not None for p in visible_files(path))


def read_records(path: str | Path, fmt: str | None = None, selection: DataSelection = DataSelection()
                 ) -> list[Record]:
    """Every record of a data file or folder (data_files: those of the chosen config and splits), in file order
    (a card's splits in its order, files sorted by path), tagged with the split each is read as."""
    return [r for f, split in data_files(path, selection) for r in read_file(f, fmt, split, selection.columns)]

"""Where instruction data lives on disk: ``.jsonl`` / ``.json`` files, or folders of them, read into Records.

``formats`` says what one record may hold; this module finds the files and reads their records in order, naming
the file and line of every mistake.
"""
from __future__ import annotations

import json
from pathlib import Path

from minigpt.errors import InputError

from .formats import Record, check_format, first_format, parse_record

SUFFIXES = (".jsonl", ".json")


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


def read_file(path: str | Path, fmt: str | None = None) -> list[Record]:
    """The records of one .jsonl or .json file; the shape comes from its first record unless `fmt` forces it."""
    path = Path(path)
    check_format(fmt)
    records: list[Record] = []
    values = _json_values(path, _decode(path))
    while True:
        try:
            line, obj = next(values)
        except StopIteration:
            break
        except RecursionError:  # json's decoder recurses once per nesting level
            raise InputError(f"{path}: JSON nested too deeply to be a record") from None
        where = f"{path}:{line}"
        _check_unicode(obj, where)
        if fmt is None:
            fmt = first_format(obj, where)
        records.append(parse_record(obj, fmt, where))
    if not records:
        raise InputError(f"{path}: no records (empty data)")
    return records


TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")  # what minigpt.data reads as plain text


def _listed(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def data_files(path: str | Path) -> list[Path]:
    """`path` itself, or the .jsonl/.json files under a folder (recursively, sorted, hidden ones skipped).

    A folder that also holds text files is refused: they would be skipped, and data is never skipped silently.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: data file or folder not found")
    if path.is_file():
        return [path]
    listed = _listed(path)
    files = [p for p in listed if p.suffix.lower() in SUFFIXES]
    if not files:
        raise InputError(f"{path}: no .jsonl or .json files in the folder")
    text = [p for p in listed if p.suffix.lower() in TEXT_SUFFIXES]
    if text:
        raise InputError(f"{path}: the folder holds .jsonl/.json files and text files ({text[0].name}); "
                         "give a folder of one kind")
    return files


def is_structured(path: str | Path) -> bool:
    """True for a .jsonl/.json file or a folder holding one: data for these readers, not plain text."""
    path = Path(path)
    if path.is_file():
        return path.suffix.lower() in SUFFIXES
    return path.is_dir() and any(p.suffix.lower() in SUFFIXES for p in _listed(path))


def read_records(path: str | Path, fmt: str | None = None) -> list[Record]:
    """Every record of a .jsonl/.json file or folder, in file order (files sorted by path)."""
    return [r for f in data_files(path) for r in read_file(f, fmt)]

"""Atomic file writes (bytes, text, JSON, safetensors), checked reads and sha256 (base folders: base_folder.py)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .errors import InputError


def umask() -> int:
    """The process's file-creation mask (Linux: read from /proc, which changes nothing; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(folder: bool = False) -> int:
    """The mode open() or mkdir() would give a new file or folder; tempfile's are private (0600 and 0700), so
    what it makes is set to this before it takes its final name, and a serving process of another user can
    read a run or an export as it can any other file."""
    return (0o777 if folder else 0o666) & ~umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: never a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    try:
        os.chmod(tmp, usual_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sorted_metadata(blob: bytes) -> bytes:
    """safetensors writes ``__metadata__`` in hash order, which differs from process to process (safetensors
    issue #584); rewrite the header with its keys sorted, so equal tensors and metadata give equal bytes."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    meta = header.get("__metadata__")
    if not meta or len(meta) < 2:
        return blob
    header["__metadata__"] = dict(sorted(meta.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > n:  # not expected: the same content in another order has the same length
        return blob
    return blob[:8] + text.ljust(n) + blob[8 + n :]  # the format allows trailing spaces in the header


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_bytes(path, sorted_metadata(save(data, metadata=metadata)))


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; a missing, truncated or foreign file is an InputError."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> dict:
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object")
    return d


def same_json(a, b) -> bool:
    """Whether two values read from JSON are the same value of the same JSON type (0 is not false, 1 not true)."""
    return type(a) is type(b) and a == b


def write_json(path: Path, d: dict) -> None:
    atomic_write_text(Path(path), json.dumps(d, indent=2, sort_keys=False) + "\n")


"""The one exception type for mistakes a user can make (bad file, bad flag, bad shape), and its field check."""
from __future__ import annotations

from dataclasses import fields


class InputError(ValueError):
    """A problem with what the user gave us; the CLI prints it as one line and exits with code 2."""


def check_known_fields(cls: type, d: dict) -> None:
    """InputError naming the keys of `d` that are not fields of the dataclass `cls` (a config read from a file)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InputError(f"unknown {cls.__name__} fields {unknown}; valid: {sorted(known)}")

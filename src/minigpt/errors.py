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


def check_config_values(cfg, positive: tuple[str, ...] = (), flags: tuple[str, ...] = (),
                        choices: dict[str, object] | None = None, fractions: tuple[str, ...] = ()) -> None:
    """InputError naming the first field of `cfg` that is not a positive finite number (`positive`), not a bool
    (`flags`: a JSON "false" string would read as true), not one of its choices (`choices`: name -> valid), or not
    a number in [0, 1) (`fractions`: dropout rates)."""
    for name in fractions:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise InputError(f"{name} must be in [0, 1), got {value!r}")
    for name in positive:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise InputError(f"{name} must be a positive finite number, got {value!r}")
    for name in flags:
        if not isinstance(getattr(cfg, name), bool):
            raise InputError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    for name, valid in (choices or {}).items():
        value = getattr(cfg, name)
        if not isinstance(value, str) or value not in valid:
            raise InputError(f"{name} must be one of {sorted(valid)}, got {value!r}")

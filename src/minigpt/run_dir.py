"""The run-folder policy: an output folder that already holds a run is refused unless told to overwrite or resume."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError
from .train_state import CHECKPOINT_DIR, list_checkpoints


def check_creatable(out: Path) -> None:
    """An InputError when `out` cannot be made a folder: it, or the nearest existing folder above it, is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{out}: cannot be created, {parent} is a file, not a folder")
            return


def check_run_dir(out: Path, markers: tuple[str, ...], overwrite: bool = False, resume: bool = False) -> None:
    """Refuse an output folder that already holds a run, unless told to overwrite or resume it.

    Nothing is deleted here: a refused or failing run leaves the folder as it was.
    """
    out = Path(out)
    if overwrite and resume:
        raise InputError("--overwrite and --resume exclude each other")
    check_creatable(out)
    if resume:
        if not list_checkpoints(out / CHECKPOINT_DIR):
            raise InputError(f"{out}: no checkpoint to resume from in {CHECKPOINT_DIR}/; "
                             "start a new run (--overwrite replaces what is there)")
        return
    held = [m for m in (*markers, CHECKPOINT_DIR) if (out / m).exists()]
    if held and not overwrite:
        raise InputError(f"{out} already holds a run ({held[0]}); "
                         "pass --overwrite to replace it or --resume to continue it")


@contextmanager
def replacing_run(out: Path, patterns: Sequence[str], markers: Sequence[str], active: bool = True) -> Iterator[None]:
    """While a new run (not a resume) writes into `out`: if `out` holds an earlier run (one of `markers`, or
    checkpoints), the files matching `patterns` wait in a hidden folder ``out/.replaced-run.*``. If the new run
    fails with a user error (InputError, FloatingPointError: a bad input found late, a loss that turned nan), the
    files it wrote are removed and the earlier ones come back (a folder it created is removed whole): the folder is
    as it was; unless it wrote a checkpoint to resume from (a nan at a late step names it), when both stay. Once
    it succeeds, the earlier run's files are deleted. A kill or Ctrl-C leaves both, nothing lost.
    Files that are not a run's (no marker beside them) are never moved or removed. `active` False (a resume, a
    rank other than 0) does nothing."""
    out = Path(out)
    if not active:
        yield
        return
    existed = out.exists()
    held = existed and any((out / m).exists() for m in (*markers, CHECKPOINT_DIR))
    kept = set() if held or not existed else set(_matching(out, patterns))  # not a run's: left alone
    aside = Path(tempfile.mkdtemp(dir=out, prefix=".replaced-run.")) if held else None
    for path in _matching(out, patterns) if held else []:
        os.replace(path, aside / path.name)
    try:
        yield
    except (InputError, FloatingPointError):
        if list_checkpoints(out / CHECKPOINT_DIR):  # the new run can go on (--resume, --skip-nonfinite): kept,
            raise  # and the earlier run's files stay in the hidden folder
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for path in set(_matching(out, patterns)) - kept:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            if aside is not None:
                for path in aside.iterdir():
                    os.replace(path, out / path.name)
                aside.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _matching(folder: Path, patterns: Sequence[str]) -> list[Path]:
    return sorted({p for pattern in patterns for p in folder.glob(pattern)})

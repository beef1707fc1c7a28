"""The run-folder policy: an output folder that already holds a run is refused unless told to overwrite or resume."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .data import BUILTIN_PREFIX
from .errors import InputError
from .train_state import CHECKPOINT_DIR, list_checkpoints


def check_creatable(out: Path) -> None:
    """An InputError when `out` cannot be made a folder and written into: it, or the nearest existing folder above
    it, is a file, or that folder takes no new entries (read-only, another user's, /proc): tried with an empty
    hidden folder made there and removed at once, before any work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise InputError(f"{out}: cannot be created, {folder} is a file, not a folder")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".write-test.", dir=folder))
            except OSError as e:
                raise InputError(f"{out}: cannot be {'written' if folder == out else 'created'} ({folder}: "
                                 f"{e.strerror or e})") from None
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
            waiting = _replaced_runs(out)
            raise InputError(f"{out}: no checkpoint to resume from in {CHECKPOINT_DIR}/; start a new run (--overwrite "
                             "replaces what is there)" + (f"; the run an --overwrite stopped before its first "
                                                          f"checkpoint replaced waits in {waiting[0]}: move its files "
                                                          "back to keep it" if waiting else ""))
        return
    held = _run_files_held(out, markers)
    if held and not overwrite:
        raise InputError(f"{out} already holds a run ({held[0]}); "
                         "pass --overwrite to replace it or --resume to continue it")
    waiting = _replaced_runs(out) if out.is_dir() else []
    if waiting and not overwrite:  # an --overwrite killed before it wrote a file left it: a new run would delete it
        raise InputError(f"{out} holds a run an --overwrite stopped before its first checkpoint replaced, in "
                         f"{waiting[0]}: move its files back to keep it, or pass --overwrite to replace it")


def check_inputs_outside_run(out: Path, patterns: Sequence[str], markers: Sequence[str],
                             inputs: dict[str, str | Path | None]) -> None:
    """An InputError for an input (flag -> path) among the earlier run's files that --overwrite moves aside before
    the new run reads anything (``replacing_run``): it would read as missing. Call only when overwriting."""
    out = Path(out)
    if not out.is_dir() or not _run_files_held(out, markers):
        return
    moved = [path.resolve() for path in _matching(out, patterns)]
    for flag, given in inputs.items():
        if given is None or str(given).startswith(BUILTIN_PREFIX):  # data shipped with the package
            continue
        path = Path(given).resolve()
        if any(path == m or m in path.parents or path in m.parents for m in moved):
            raise InputError(f"{flag} {given} reads the run in {out} that --overwrite replaces: "
                             "copy what it needs elsewhere first")


@contextmanager
def replacing_run(out: Path, patterns: Sequence[str], markers: Sequence[str], active: bool = True,
                  resuming: bool = False) -> Iterator[None]:
    """While a new run (not a resume) writes into `out`: if `out` holds an earlier run (one of `markers`, or
    checkpoints), its files (those matching `patterns`) wait in a hidden folder ``out/.replaced-run.*``. If the new
    run fails before writing a checkpoint (a user error found late, a NaN at the first step, out of memory or disk,
    Ctrl-C), what it wrote (every entry of `out` that was not there before it) is removed and the earlier files
    come back (a folder it created is removed whole): the folder is as it was. A run that fails after a checkpoint
    keeps it for --resume, and the earlier run stays in the hidden folder. Once the new run succeeds, the earlier
    run's files are deleted, as they are when a `resuming` run (one killed after its checkpoint) succeeds. Files
    that are not a run's are never moved or removed. `active` False (a rank other than 0) does nothing."""
    out = Path(out)
    if not active:
        yield
        return
    if resuming:  # the run that replaced an earlier one (killed, then resumed): once it succeeds, that one goes
        yield
        for old in _replaced_runs(out):
            shutil.rmtree(old, ignore_errors=True)
        return
    existed = out.exists()
    held = existed and bool(_run_files_held(out, markers))
    # runs an --overwrite killed before its first checkpoint replaced (check_run_dir let this run in: --overwrite)
    earlier = _replaced_runs(out) if existed else []
    aside = Path(tempfile.mkdtemp(dir=out, prefix=REPLACED_PREFIX)) if held else None
    for path in _matching(out, patterns) if held else []:
        os.replace(path, aside / path.name)
    before = set(out.iterdir()) if existed else set()  # the user's own files, and the hidden folder
    try:
        yield
    except BaseException as e:
        if list_checkpoints(out / CHECKPOINT_DIR):  # the new run can go on (--resume, --skip-nonfinite): kept
            if aside is not None and isinstance(e, (InputError, FloatingPointError, KeyboardInterrupt)):
                said = f"{e.args[0]}; " if e.args else ""
                e.args = (f"{said}the run it replaced waits in {aside}",)
            raise
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for path in set(out.iterdir()) - before:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            if aside is not None:
                for path in aside.iterdir():
                    os.replace(path, out / path.name)
                aside.rmdir()
        raise
    for replaced in ([aside] if aside is not None else []) + earlier:  # the new run stands: what it replaced goes
        shutil.rmtree(replaced, ignore_errors=True)


REPLACED_PREFIX = ".replaced-run."


def _replaced_runs(out: Path) -> list[Path]:
    """The hidden folders in `out` holding runs an --overwrite replaced (``replacing_run``), newest first."""
    return sorted((p for p in Path(out).glob(REPLACED_PREFIX + "*") if p.is_dir()),
                  key=lambda p: p.stat().st_mtime_ns, reverse=True)


def _run_files_held(out: Path, markers: Sequence[str]) -> list[str]:
    """The markers (and the checkpoint folder) that `out` holds: any of them and it holds a run."""
    return [m for m in (*markers, CHECKPOINT_DIR) if (out / m).exists()]


def _matching(folder: Path, patterns: Sequence[str]) -> list[Path]:
    return sorted({p for pattern in patterns for p in folder.glob(pattern)})

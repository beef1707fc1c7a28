"""The run-folder policy: an output folder that already holds a run is refused unless told to overwrite or resume."""
from __future__ import annotations

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

"""What a finetune run recorded in its manifest.json, as export, generate and eval read it: the base it trained on
and its window.

    check_run_base(base, adapter)   # an InputError when the run holding `adapter` recorded other base weights
    trained_seq_len(adapter)        # the run's --seq-len (None: no run manifest)
    run_quant_scheme(adapter)       # the scheme a QLoRA run quantized its targets by (None: LoRA; its adapter file
                                    # records it too, for a file read without its run)
    trained_precision(adapter)      # "fp32" or "bf16", what the run computed in
    trained_selection(adapter, data)  # the run's --data-config, --data-split and --columns, for its own --data
    trained_reading(adapter, data)    # the run's --format, --train-on-inputs and --overlong, for its own --data

A run's manifest.json records ``base_sha256`` (``base_model.base_weights_sha256``: every checkpoint file's bytes)
and ``base_files``, each checkpoint file's size, modification time, inode and status change time. An adapter
applied to another model of the same shapes loads, generates and merges without a sign, so ``export``,
``generate`` and ``eval`` check the base before using it. When every file is still the one the run saw, untouched
(the four stats equal), the weights are taken as unchanged, so a 7B base (13 GB, ~10 s of sha256 here) is not
hashed on every ``generate``; otherwise, or for a manifest without ``base_files`` (runs before it was recorded, or
before it held inodes), the sha256 decides.
"""
from __future__ import annotations

from pathlib import Path

from minigpt.base_folder import MANIFEST
from minigpt.device import PRECISIONS
from minigpt.errors import InputError
from minigpt.io import read_json, same_json

from .adapter_io import adapter_file_base, adapter_file_scheme
from .base_model import base_weights_sha256
from .hf_load import checkpoint_files
from .qlora import check_scheme
from .sft.examples import OVERLONG
from .sft.formats import FORMATS, DataSelection, check_columns, check_data_splits


def base_file_stats(folder: str | Path) -> dict[str, list[int]]:
    """Checkpoint file name -> [bytes, modification time in ns, inode, status change time in ns] of a base folder's
    weights: the same file, untouched since. Size and mtime alone would pass another model of the same shapes
    where mtimes are normalised (a Nix store, a reproducible tar, `rsync -a` from one); a copy of the file has
    another inode and ctime, so it is hashed."""
    return {f.name: [(st := f.stat()).st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
            for f in checkpoint_files(Path(folder))}


def run_manifest(adapter: str | Path) -> dict | None:
    """The manifest.json of the finetune run holding `adapter` (None: no run manifest), looked for in `adapter`
    when it is a folder, and in the folder holding it (a run's adapter file or its adapter_peft/)."""
    adapter = Path(adapter)
    for folder in ([adapter] if adapter.is_dir() else []) + [adapter.parent]:
        if (folder / MANIFEST).is_file():
            manifest = read_json(folder / MANIFEST)
            config, sha = manifest.get("config", {}), manifest.get("base_sha256")
            if not isinstance(config, dict) or not (sha is None or isinstance(sha, str)):
                raise InputError(f"{folder / MANIFEST}: not a run's manifest ('config' must be an object, "
                                 "'base_sha256' a string)")
            return manifest
    return None


def check_run_base(base: str | Path, adapter: str | Path, use: str = "merge") -> None:
    """An InputError when the run holding `adapter` recorded other base weights (sha256) than `base` holds: its
    manifest's record, else (an adapter file without its run) the file's own; nothing to check for a PEFT folder
    without its run or an older file. `use` names what --allow-other-base would do anyway ("merge", "use")."""
    manifest = run_manifest(adapter)
    recorded, where = (manifest.get("base_sha256"), "manifest") if manifest else (None, "")
    if not recorded:  # no run manifest, or one without the record (older, or edited): the adapter file's own
        # (a run's adapter_peft/ holds none: its run's adapter file, beside it, records the same base)
        recorded = adapter_file_base(adapter) or (adapter_file_base(Path(adapter).parent) if manifest else None)
        where, manifest = "file", None
    if not recorded or (manifest and manifest.get("base_files") == base_file_stats(base)):
        return
    sha, _ = base_weights_sha256(base)
    if sha != recorded:
        raise InputError(f"{base}: not the base this adapter's run trained on (its {where} records weights sha256 "
                         f"{recorded[:12]}..., these are {sha[:12]}...); pass that base, or --allow-other-base to "
                         f"{use} it anyway")


def _run_config(adapter: str | Path | None) -> dict:
    """The `config` object of the run manifest holding `adapter` ({} without an adapter or a run manifest)."""
    return ((run_manifest(adapter) or {}).get("config") or {}) if adapter is not None else {}


def trained_seq_len(adapter: str | Path | None) -> int | None:
    """The training window (``seq_len``) the finetune run holding `adapter` recorded; None without a run manifest
    or where the run took the model's default. Anything else recorded there is an InputError (an edited manifest)."""
    seq_len = _run_config(adapter).get("seq_len")
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise InputError(f"{adapter}: its run's {MANIFEST} records seq_len {seq_len!r}, not a positive integer")
    return seq_len


def run_quant_scheme(adapter: str | Path) -> str | None:
    """The quant_scheme the finetune run holding `adapter` trained on: its manifest's, else (an adapter file
    without its run) the one the file records; None for a float base, or where neither says."""
    manifest = run_manifest(adapter)
    scheme = (manifest.get("config") or {}).get("quant_scheme") if manifest else adapter_file_scheme(adapter)
    return check_scheme(scheme) if scheme else None


def trained_precision(adapter: str | Path | None) -> str:
    """The precision ("fp32" or "bf16") the finetune run holding `adapter` trained in; "fp32" without a run manifest."""
    train = _run_config(adapter).get("train")
    precision = train.get("precision", "fp32") if isinstance(train, dict) else "fp32"
    if precision not in PRECISIONS:
        raise InputError(f"{adapter}: its run's {MANIFEST} records precision {precision!r}; "
                         f"valid: {', '.join(PRECISIONS)}")
    return precision


def _pairs(value, what: str, manifest: str) -> tuple[tuple[str, str], ...]:
    """A manifest's {a: b} object as (a, b) pairs."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InputError(f"{manifest}: {what} is an object of names, got {value!r}")
    return tuple(value.items())


def _same_data(recorded: str, data: str) -> bool:
    """Whether `data` names the data a run recorded: the same words, or the same file or folder on disk."""
    if recorded == data:
        return True
    on_disk = not data.startswith("builtin:") and Path(recorded).exists()
    return on_disk and Path(recorded).resolve() == Path(data).resolve()


def _config_for_data(adapter: str | Path | None, data: str) -> dict:
    """The run manifest's config where `data` names the data the run holding `adapter` recorded (the path it
    recorded, or the same file or folder); else {}."""
    config = _run_config(adapter)
    recorded = config.get("data")
    return config if isinstance(recorded, str) and _same_data(recorded, data) else {}


def trained_selection(adapter: str | Path | None, data: str) -> DataSelection:
    """The --data-config, --data-split and --columns the finetune run holding `adapter` read its data with, when
    `data` names that same data (the path it recorded, or the same file or folder); else the flags' defaults."""
    config = _config_for_data(adapter, data)
    if not config:
        return DataSelection()
    where = f"{adapter}'s run manifest"
    name = config.get("data_config")
    if name is not None and not isinstance(name, str):
        raise InputError(f"{where}: data_config is a config's name, got {name!r}")
    return DataSelection(name, check_data_splits(_pairs(config.get("data_splits", {}), "data_splits", where)),
                         check_columns(_pairs(config.get("columns", {}), "columns", where)))


def trained_reading(adapter: str | Path | None, data: str) -> dict:
    """{"format", "train_on_inputs", "overlong"}: how the finetune run holding `adapter` read `data` when that is
    its own data (``trained_selection``), each as its manifest recorded it ({} for other data, or no run). An
    InputError for a value finetune never records (an edited manifest)."""
    config = _config_for_data(adapter, data)
    where = f"{adapter}'s run manifest"
    reading = {k: config[k] for k in ("format", "train_on_inputs", "overlong") if k in config}
    for key, valid in (("format", (None, *FORMATS)), ("train_on_inputs", (False, True)), ("overlong", OVERLONG)):
        if key in reading and not any(same_json(reading[key], v) for v in valid):
            raise InputError(f"{where}: {key} is {reading[key]!r}; valid: {', '.join(map(str, valid))}")
    return reading

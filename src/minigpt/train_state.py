"""Resumable training checkpoints: one safetensors file per checkpoint, written atomically.

A checkpoint holds what the training loop needs to go on as if it had never stopped: the trainable
parameters (an adapter, or every weight in full fine-tuning), the optimizer state (AdamW's moments and
its step counts, which are tensors), the RNG states (python, numpy, torch CPU and CUDA) and the state of
the batch generator, which is the position in the data stream; the LR schedule needs only the step.
Tensors go in the safetensors body and everything else in one small JSON string in its metadata, so a
checkpoint is a single file that appears whole (temporary file, fsync, rename, fsync of the folder) or
not at all. Nothing is pickled.

    checkpoints/step-00000010.safetensors
        param.<name>      trainable parameters, in optimizer order
        optim.<i>.<key>   optimizer state of parameter i (exp_avg, exp_avg_sq, step)
        rng.torch, rng.batches, rng.cuda.<d>
        metadata: {"format": "minigpt-train-state-v1", "state": JSON}
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from .errors import InputError
from .io import atomic_save_safetensors

FORMAT = "minigpt-train-state-v1"
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d+)\.safetensors$")
_TMP_PREFIX = ".tmp-step-"  # what minigpt.io.atomic_write_bytes names a checkpoint before its rename


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    params: dict[str, torch.Tensor]  # trainable parameters by name, in optimizer order
    optimizer: dict  # torch.optim state_dict(): {"state": {i: {key: value}}, "param_groups": [...]}
    rng: dict  # capture_rng(): python, numpy, torch, cuda, batches
    info: dict = field(default_factory=dict)  # JSON: the run's config and fingerprint, val loss, elapsed time, resumes


def capture_rng(batches: torch.Generator) -> dict:
    """Every random stream a training step may draw from, plus the batch generator (the data position)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "batches": batches.get_state(),
    }


def restore_rng(rng: dict, batches: torch.Generator) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"]:
        if len(rng["cuda"]) != torch.cuda.device_count():
            raise InputError(f"the checkpoint holds RNG states of {len(rng['cuda'])} CUDA devices, "
                             f"this machine has {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all(rng["cuda"])
    batches.set_state(rng["batches"])


def to_file(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten a TrainState into safetensors tensors and string metadata (pure)."""
    tensors = {f"param.{n}": p.detach() for n, p in state.params.items()}
    opt_scalars: dict[str, dict] = {}
    for i, entry in state.optimizer["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{i}.{key}"] = value
            else:
                opt_scalars.setdefault(str(i), {})[key] = value
    tensors["rng.torch"] = state.rng["torch"]
    tensors["rng.batches"] = state.rng["batches"]
    for d, s in enumerate(state.rng["cuda"]):
        tensors[f"rng.cuda.{d}"] = s
    meta = {
        "step": state.step,
        "params": list(state.params),
        "param_groups": state.optimizer["param_groups"],
        "optimizer_scalars": opt_scalars,
        "rng": {"python": state.rng["python"], "numpy": state.rng["numpy"], "cuda_devices": len(state.rng["cuda"])},
        "info": state.info,
    }
    return tensors, {"format": FORMAT, "state": json.dumps(meta)}


def from_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str], where: Path) -> TrainState:
    """The inverse of to_file; a file that is not a complete train state is an InputError."""
    if metadata.get("format") != FORMAT:
        raise InputError(f"{where}: not a {FORMAT} checkpoint")
    try:
        meta = json.loads(metadata["state"])
        params = {n: tensors[f"param.{n}"] for n in meta["params"]}
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, i, name = key.split(".", 2)
                state.setdefault(int(i), {})[name] = value
        for i, scalars in meta["optimizer_scalars"].items():
            state.setdefault(int(i), {}).update(scalars)
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in meta["param_groups"]]
        rng = {"python": meta["rng"]["python"], "numpy": meta["rng"]["numpy"], "torch": tensors["rng.torch"],
               "batches": tensors["rng.batches"],
               "cuda": [tensors[f"rng.cuda.{d}"] for d in range(meta["rng"]["cuda_devices"])]}
        return TrainState(int(meta["step"]), params, {"state": state, "param_groups": groups}, rng, meta["info"])
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise InputError(f"{where}: damaged checkpoint ({type(e).__name__}: {e})") from None


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}.safetensors"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in a folder, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return sorted(found)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_partial(folder: Path) -> None:
    """Delete temporary files left by a checkpoint write that was killed before its rename."""
    for p in Path(folder).glob(f"{_TMP_PREFIX}*"):
        p.unlink(missing_ok=True)


def save_checkpoint(folder: Path, state: TrainState, keep: int) -> Path:
    """Write state atomically as step-<step>.safetensors, then keep only the newest `keep` checkpoints."""
    folder = Path(folder)
    path = checkpoint_path(folder, state.step)
    tensors, metadata = to_file(state)
    atomic_save_safetensors(tensors, path, metadata=metadata)
    _fsync_dir(folder)
    for _, old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    remove_partial(folder)
    return path


def load_checkpoint(path: Path) -> TrainState:
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: not a readable checkpoint ({why})") from None
    state = from_file(tensors, metadata, path)
    _check_finite(state, path)
    return state


def _check_finite(state: TrainState, where: Path) -> None:
    """InputError where a parameter or an optimizer moment holds nan or inf (a damaged checkpoint: resumed, a nan
    moment would make every parameter it updates nan at the next step)."""
    named = [(f"parameter {n}", t) for n, t in state.params.items()]
    named += [(f"optimizer state {i}.{k}", t) for i, st in state.optimizer["state"].items() for k, t in st.items()
              if torch.is_tensor(t)]
    bad = [n for n, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise InputError(f"{where}: {bad[0]} holds nan or inf (a damaged checkpoint)")


def latest_checkpoint(folder: Path, log: Callable[[str], None] = print) -> tuple[TrainState, Path] | None:
    """The newest checkpoint that loads; a damaged one is reported and the one before it is tried."""
    for _, path in reversed(list_checkpoints(folder)):
        try:
            return load_checkpoint(path), path
        except InputError as e:
            log(f"warning: skipping {e}")
    return None


def clear_checkpoints(folder: Path) -> None:
    """Remove the checkpoints of an earlier run (a fresh run, or --overwrite, must not resume them)."""
    folder = Path(folder)
    for _, path in list_checkpoints(folder):
        path.unlink()
    if folder.is_dir():
        remove_partial(folder)
        if not any(folder.iterdir()):
            folder.rmdir()


def _differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


def check_compatible(info: dict, run: dict, where: Path) -> None:
    """Refuse to resume a checkpoint written by a run with another config, data or base."""
    run = json.loads(json.dumps(run))  # compare as stored: tuples become lists
    diff = _differences({k: info.get(k) for k in run}, run)
    if diff:
        shown = "; ".join(diff[:3]) + (f"; ... {len(diff) - 3} more" if len(diff) > 3 else "")
        raise InputError(f"{where} was written by a different run ({shown}); "
                         "resume with the same settings, or pass --overwrite to start over")


KERNEL_CHOICES = ("fused", "foreach")  # how torch's AdamW runs: chosen by this run, not by the checkpoint's


def keep_kernel_choice(optimizer: torch.optim.Optimizer, built: list[dict]) -> None:
    """After load_state_dict (which takes every group setting from the checkpoint), put back how this run's
    optimizer was built to run: a checkpoint written by the single-tensor loop (before minigpt.train.adamw was
    fused) then resumes fused, as the planner counts it; the update is the same to about one fp32 unit."""
    for group, choice in zip(optimizer.param_groups, built):
        group.update(choice)
        if group.get("fused"):  # the fused kernel takes each step count as an fp32 tensor on its parameter's device
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(dtype=torch.float32, device=p.device)


def restore(state: TrainState, named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
            batches: torch.Generator, where: Path) -> None:
    """Copy a checkpoint into the trainable parameters, the optimizer, the RNGs and the batch generator."""
    names = [n for n, _ in named_params]
    wrong = [f"{n} (checkpoint {tuple(state.params[n].shape)}, model {tuple(p.shape)})"
             for n, p in named_params if n in state.params and state.params[n].shape != p.shape]
    if names != list(state.params) or wrong:
        missing = sorted(set(names) - set(state.params))[:3]
        unexpected = sorted(set(state.params) - set(names))[:3]
        raise InputError(f"{where} does not fit this model: missing {missing}, unexpected {unexpected}, "
                         f"wrong shape {wrong[:2]}")
    _check_finite(state, where)
    with torch.no_grad():
        for n, p in named_params:
            p.copy_(state.params[n])
    built = [{k: g[k] for k in KERNEL_CHOICES if k in g} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state.optimizer)
    except (ValueError, KeyError, RuntimeError) as e:
        raise InputError(f"{where}: optimizer state does not fit this run ({e})") from None
    keep_kernel_choice(optimizer, built)
    try:
        restore_rng(state.rng, batches)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:  # InputError is a ValueError: kept
        if isinstance(e, InputError):
            raise
        raise InputError(f"{where}: its random number states are damaged ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]}); --overwrite starts over") from None

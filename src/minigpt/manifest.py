"""Reproducibility: seeding, and the manifest.json every run and lab writes."""
from __future__ import annotations

import platform
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from .io import sha256_file, write_json

PACKAGES = ("torch", "numpy", "safetensors", "minituner", "peft", "transformers", "bitsandbytes")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch so that CPU runs repeat exactly."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent,
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def write_manifest(
    path: Path,
    *,
    seed: int | None,
    config: dict,
    wall_time_s: float,
    base_weights: Path | None = None,
    adapter: Path | None = None,
    extra: dict | None = None,
) -> dict:
    """Write manifest.json: versions, seed, git commit, sha256 of the base (and adapter), config, wall time."""
    manifest = {
        "versions": package_versions(),
        "platform": f"{platform.system()} {platform.machine()}",
        "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:]),
        "git_commit": git_commit(),
        "seed": seed,
        "base_sha256": sha256_file(base_weights) if base_weights else None,
        "adapter_sha256": sha256_file(adapter) if adapter else None,
        "config": config,
        "wall_time_s": round(wall_time_s, 3),
    }
    if extra:
        manifest.update(extra)
    write_json(Path(path), manifest)
    return manifest

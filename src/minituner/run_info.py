"""What a lab records about a run besides its numbers: paths as the repository names them, how the base was
pretrained (from its manifest.json), and text sampled from a model."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from minigpt.base_folder import MANIFEST
from minigpt.io import read_json

from .base_model import Tokenizer


def display_path(path: Path, root: Path) -> str:
    """`path` relative to `root` when it lies inside it (so a report reads the same on every machine)."""
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def base_pretrain(base: Path) -> dict | None:
    """How the base was pretrained (steps, data, final val loss), from its manifest.json; None without one."""
    if not (Path(base) / MANIFEST).is_file():
        return None
    m = read_json(Path(base) / MANIFEST)
    return {"steps": m["config"]["train"]["steps"], "data": m["config"]["data"],
            "val_loss": m.get("results", {}).get("final_val_loss")}


def sample_texts(model: nn.Module, tokenizer: Tokenizer, prompts: tuple[str, ...], n_tokens: int = 120,
                 temperature: float = 0.8, seed: int = 0) -> list[str]:
    """One continuation per prompt, drawn from one seeded generator in prompt order."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([tokenizer.encode(p)]), n_tokens, temperature=temperature, generator=gen)
        out.append(tokenizer.decode(ids[0].tolist()))
    return out

"""The float dtype each part of a base is stored in, by the planner's parts, for a checkpoint that mixes them.

    stored_dtypes([("model.layers.0.self_attn.q_proj.weight", torch.bfloat16, 4194304), ...])
    # -> {"self_attn.q_proj": torch.bfloat16, ..., "token_embedding": torch.float32, "lm_head": torch.float32}

Under fp32 compute on a 16-bit base, LoRA and QLoRA keep every 16-bit block Linear, embedding and head as stored
(``minituner.upcast``) and the fp32 ones as they are, so the weights the run holds depend on each part's dtype,
not on the checkpoint's. Most checkpoints store one float dtype; some mix them (bf16 blocks beside an fp32
embedding and head, or fp32 norms), and planning the whole model in the dtype holding most values is wrong by
the difference. The parts are the planner's: a block Linear by its path inside a block
(``planner.shapes.LinearShape.path``: "self_attn.q_proj", "attn.q_proj", ...; its bias goes with it), and
"token_embedding", "position_embedding", "lm_head". Norms are not parts here: the build casts them to fp32.
Names are those of the checkpoint and of the model built from it (Hugging Face's for the llama family,
MiniGPT's own), so a folder's tensor headers and a loaded model's named_parameters give the same answer.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from ..precision import dtype_of_most_values

EMBEDDING_PARTS = ("token_embedding", "position_embedding", "lm_head")
_WHOLE_MODEL = {"embed_tokens.weight": "token_embedding", "wte.weight": "token_embedding",
                "embed_positions.weight": "position_embedding", "wpe.weight": "position_embedding",
                "lm_head.weight": "lm_head"}
_IN_A_BLOCK = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+\.(.+)\.(?:weight|bias)$")


def part_of(name: str) -> str | None:
    """A tensor's name -> the planner's part it belongs to (None: a norm, a LoRA factor, or nothing the planner
    splits). A LoRA-wrapped Linear's base weight (``...q_proj.base_layer.weight``) is its Linear's."""
    if ".lora_" in name:
        return None
    name = name.replace(".base_layer.", ".")
    for suffix, part in _WHOLE_MODEL.items():
        if name == suffix or name.endswith("." + suffix):
            return part
    m = _IN_A_BLOCK.search(name)
    if m is None:
        return None
    leaf = m.group(1).rsplit(".", 1)[-1]
    return None if "norm" in leaf or leaf.startswith("ln_") else m.group(1)


def stored_dtypes(tensors: Iterable[tuple[str, torch.dtype, int]]) -> dict[str, torch.dtype]:
    """(name, dtype, numel) of a checkpoint's or a model's float tensors -> part -> the dtype holding most of
    that part's values (over all blocks). A tied head stored once is the token embedding's."""
    sizes: dict[str, list[tuple[torch.dtype, int]]] = {}
    for name, dtype, numel in tensors:
        part = part_of(name)
        if part is not None and dtype.is_floating_point:
            sizes.setdefault(part, []).append((dtype, numel))
    out = {part: dtype_of_most_values(s) for part, s in sizes.items()}
    if "lm_head" not in out and "token_embedding" in out:
        out["lm_head"] = out["token_embedding"]
    return out


def dtype_of(stored: torch.dtype | Mapping[str, torch.dtype], part: str) -> torch.dtype:
    """The dtype `part` is stored in: `stored` itself when it is one dtype for the whole base, else its entry
    (float32 for a part it does not name)."""
    return stored if isinstance(stored, torch.dtype) else stored.get(part, torch.float32)

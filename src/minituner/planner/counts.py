"""Parameter counts per module kind, LoRA targets and LoRA trainable counts: pure arithmetic.

LoRA on a Linear(in, out) adds A (r x in) and B (out x r): r * (in + out) trainable parameters
(Hu et al. 2021). Targets match PEFT's rule: a name matches a module whose path equals it or ends
with "." + name, so GPT-2's ``c_proj`` matches both ``attn.c_proj`` and ``mlp.c_proj``;
``all-linear`` is every Linear inside the blocks, never the output head. Biases stay frozen and are
not LoRA-ed (PEFT's default ``bias="none"``).
"""
from __future__ import annotations

from collections.abc import Iterable

from minigpt.errors import InputError

from .shapes import ATTENTION, LinearShape, ModelShape

NF4_BLOCK = 64  # weights per fp32 absmax (bitsandbytes' default blocksize for 4-bit)
ALL_LINEAR = "all-linear"
# Module kinds, in table order; every base parameter belongs to exactly one.
KINDS = ("token_embedding", "position_embedding", "attention", "attention_bias", "mlp", "mlp_bias",
         "norm", "lm_head")


def param_counts(shape: ModelShape) -> dict[str, int]:
    """Base parameters per module kind, each counted once (a tied lm_head is 0: it is the embedding)."""
    L, h = shape.n_layer, shape.d_model
    counts = dict.fromkeys(KINDS, 0)
    counts["token_embedding"] = shape.vocab_size * h
    counts["position_embedding"] = shape.n_positions * h
    for lin in shape.linears:
        weight_kind = "attention" if lin.kind == ATTENTION else "mlp"
        counts[weight_kind] += L * lin.weight_params
        counts[weight_kind + "_bias"] += L * lin.bias_params
    counts["norm"] = L * sum(n.params for n in shape.norms) + shape.final_norm.params
    counts["lm_head"] = 0 if shape.tie_embeddings else h * shape.vocab_size
    return counts


def total_params(shape: ModelShape) -> int:
    """Every base parameter once (tied weights once): sum(p.numel()) of the instantiated model."""
    return sum(param_counts(shape).values())


def block_linear_weights(shape: ModelShape) -> int:
    """Weights (no biases) of one block's Linears: 12 h^2 for a GPT block with d_ff = 4h."""
    return sum(lin.weight_params for lin in shape.linears)


def valid_targets(shape: ModelShape) -> list[str]:
    """all-linear, the leaf names, and block paths where a leaf name is shared (GPT-2's attn./mlp.c_proj)."""
    leaves = [lin.name for lin in shape.linears]
    shared = sorted(lin.path for lin in shape.linears if leaves.count(lin.name) > 1)
    return [ALL_LINEAR, *sorted(set(leaves)), *shared]


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """"q_proj,v_proj" / ["q_proj", "v_proj"] / "all-linear" -> a tuple of names (no empties)."""
    items = [targets] if isinstance(targets, str) else list(targets)
    names = tuple(t.strip() for item in items for t in str(item).split(",") if t.strip())
    if not names:
        raise InputError(f"no LoRA target given; use {ALL_LINEAR} or module names such as q_proj,v_proj")
    return tuple(ALL_LINEAR if n.lower() == ALL_LINEAR else n for n in names)


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def resolve_targets(shape: ModelShape, targets: str | Iterable[str] = ALL_LINEAR) -> tuple[LinearShape, ...]:
    """The block Linears LoRA wraps for these targets; an unknown name is an InputError listing valid ones."""
    names = parse_targets(targets)
    unknown = [n for n in names if n != ALL_LINEAR and not any(_matches(lin.path, n) for lin in shape.linears)]
    if unknown:  # beside all-linear too (as minituner.lora.find_targets): lm_head is never silently dropped
        raise InputError(f"unknown LoRA target {', '.join(unknown)} for {shape.family}; "
                         f"valid: {', '.join(valid_targets(shape))}")
    if ALL_LINEAR in names:
        return shape.linears
    return tuple(lin for lin in shape.linears if any(_matches(lin.path, n) for n in names))


def check_rank(r) -> int:
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise InputError(f"LoRA rank r must be a positive integer (e.g. 4, 8, 16), got {r!r}")
    return r


def lora_params(lin: LinearShape, r: int) -> int:
    """A (r x in) + B (out x r) = r * (in + out)."""
    return check_rank(r) * (lin.in_features + lin.out_features)


def lora_trainable_params(shape: ModelShape, r: int, targets: str | Iterable[str] = ALL_LINEAR) -> int:
    """LoRA parameters over the whole model: n_layer * sum of r * (in + out) over the targeted Linears."""
    check_rank(r)
    return shape.n_layer * sum(lora_params(lin, r) for lin in resolve_targets(shape, targets))


def adapter_bytes(shape: ModelShape, r: int, targets: str | Iterable[str] = ALL_LINEAR,
                  bytes_per_param: int = 2) -> int:
    """Size of the adapter's tensors on disk (fp16 by default), without the file header."""
    return bytes_per_param * lora_trainable_params(shape, r, targets)

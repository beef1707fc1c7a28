"""Markdown for plans: the regime table (with a "ratio vs full FT" column) and the per-kind count table.

Sizes are in MiB or GiB, 1024-based, with the unit in every column header.
"""
from __future__ import annotations

from .activations import dropout_phrase
from .counts import KINDS, param_counts, resolve_targets, total_params
from .memory import Plan
from .shapes import ModelShape

UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


FORWARDS = {f: "the Decoder (minigpt.decoder)" for f in ("llama", "mistral", "qwen2")}  # whose forward the exact model is

def pick_unit(plan: Plan) -> str:
    """MiB unless the largest regime needs 10 GiB or more."""
    largest = max(r.bytes.total for r in plan.regimes)
    return "GiB" if largest >= 10 * UNITS["GiB"] else "MiB"


def size(n_bytes: int, unit: str, decimals: int = 2) -> str:
    return f"{n_bytes / UNITS[unit]:,.{decimals}f}"


def percent(x: float) -> str:
    """Three significant figures, trailing zeros kept: 100%, 17.2%, 0.150%."""
    v = 100 * float(x)
    if v == 0 or v >= 100:
        return f"{v:.0f}%"
    return f"{v:#.3g}".rstrip(".") + "%"


def regime_table(plan: Plan, unit: str | None = None) -> str:
    unit = unit or pick_unit(plan)
    largest = max(r.bytes.total for r in plan.regimes) / UNITS[unit]
    dec = 3 if largest < 100 else 2  # small models: 0.001 MiB = 1 KiB resolution
    full = next((r for r in plan.regimes if r.regime.name == "full"), None)
    peak = any(r.bytes.peak is not None for r in plan.regimes)  # a peak column where the shape has a peak model
    head = (f"| regime | trainable params | frozen params | ratio vs full FT | weights {unit} | grads {unit} "
            f"| optimizer {unit} | activations {unit} | total {unit} | memory vs full FT |"
            + (f" step peak {unit} | peak at |" if peak else ""))
    lines = [head, "|---" * (12 if peak else 10) + "|"]
    for r in plan.regimes:
        b = r.bytes
        mem = percent(b.total / full.bytes.total) if full else "n/a"
        lines.append(
            f"| {r.regime.label} | {r.trainable_params:,} | {r.frozen_params:,} | {percent(r.ratio_vs_full)} "
            f"| {size(b.weights, unit, dec)} | {size(b.grads, unit, dec)} | {size(b.optimizer, unit, dec)} "
            f"| {size(b.activations, unit, dec)} | {size(b.total, unit, dec)} | {mem} |"
            + (f" {size(b.peak, unit, dec)} | {b.peak_phase} |" if peak and b.peak is not None else "")
            + (" – | – |" if peak and b.peak is None else "")
        )
    return "\n".join(lines)


def kinds_table(shape: ModelShape) -> str:
    """Base parameters per module kind, with their share of the total."""
    counts, n = param_counts(shape), total_params(shape)
    lines = ["| module kind | params | share |", "|---|---|---|"]
    for kind in KINDS:
        note = " (tied: shares token_embedding)" if kind == "lm_head" and shape.tie_embeddings else ""
        lines.append(f"| {kind}{note} | {counts[kind]:,} | {percent(counts[kind] / n)} |")
    lines.append(f"| **total** | **{n:,}** | 100% |")
    return "\n".join(lines)


def describe(plan: Plan, alpha: float | None = None) -> str:
    """One paragraph of assumptions to print above the table."""
    s, c = plan.shape, plan.config
    wrapped = resolve_targets(s, plan.targets)
    precision = {"weights": "fp16 weights + fp32 master (weights bucket, the seed's split), fp16 grads, fp32 Adam",
                 "optimizer": "fp16 weights and grads + fp32 master + Adam (master in the optimizer bucket, ZeRO's split)"
                 }[c.master_copy] if c.full_precision == "mixed" else "fp32 weights, grads, Adam"
    act = {"seed": "batch x seq x d_model x n_layer x 16 bytes", "korthikanti": "Korthikanti et al. 2022",
           "exact": f"saved for backward by {FORWARDS.get(s.family, 'MiniGPT')}'s forward"
                    f"{' (GPT-2 imported into it)' if s.family == 'gpt2' else ''}"
                    f" ({c.dtype}"
                    f"{', each block recomputed in backward' if c.grad_checkpoint else ''}); step peak: what is alive "
                    "at the worst phase of a step (planner/peak.py; the process itself not included)"}[c.activations]
    parts = [
        f"{s.name} ({s.family}): {plan.total_params:,} parameters, d_model {s.d_model}, {s.n_layer} layers, "
        f"vocab {s.vocab_size:,}, {'tied' if s.tie_embeddings else 'untied'} embeddings.",
        f"LoRA targets {', '.join(plan.targets)} -> {len(wrapped)} Linears per block "
        f"({', '.join(lin.path for lin in wrapped)}); biases frozen, not LoRA-ed.",
        f"Full FT: {precision}. QLoRA: "
        + ("the targeted Linears" if c.quantize == "targets" else "every block Linear (bitsandbytes load_in_4bit)")
        + f" in NF4{' with double quantization' if c.double_quant else ''}, the rest fp16.",
        f"Activations: {act}, batch {c.batch_size}, seq {c.seq_len}"
        + (f", {c.counted_targets:,} of the {c.batch_size * c.seq_len:,} targets counted (the head and the loss run "
           "on those rows)" if c.counted_targets is not None else "")
        + (f", {c.grad_accum} batches a step (gradient accumulation: the step peak holds every gradient in each "
           "backward after the first)" if c.grad_accum > 1 else "")
        + dropout_phrase(c.model_dropout, c.lora_dropout, ", ") + ". Sizes 1024-based.",
    ]
    if s.family == "gpt2" and any(lin.name == "c_attn" for lin in wrapped) and any(r.regime.rank for r in plan.regimes):
        lora = {row.regime.rank: row.trainable_params for row in plan.regimes if row.regime.rank}  # rank -> PEFT's count
        ours = [f"{n + 2 * r * s.d_model * s.n_layer:,} at r={r}" for r, n in sorted(lora.items())]
        parts.append("GPT-2's attn.c_attn is counted as PEFT wraps it, fused: r·(d + 3d) per block. minituner's "
                     "finetune splits it into q_proj, k_proj, v_proj, r·(3d + 3d), so it trains "
                     + ", ".join(ours) + ".")
    if c.quantize != "targets" and c.activations == "exact" and any(r.regime.name == "qlora" for r in plan.regimes):
        parts.append("No step peak for QLoRA with every block Linear in NF4: the peak model follows minituner's "
                     "finetune, which quantizes the LoRA targets only (its buckets in the table are counted as for "
                     "the others).")
    if alpha is not None:
        parts.append(f"lora_alpha {alpha:g} scales the update (alpha/r) and changes no count or byte.")
    return "\n".join(parts)

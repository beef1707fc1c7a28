"""PHASE_28_REPORT.md: the three Phase 28 labs on one page, from their committed results.

    python experiments/phase28_report.py

Lab 01 is arithmetic, so its figures are recomputed by the planner for the shape Lab 02 trained; Labs 02
and 03 are read from their results.json. Every number is printed by this script; a test regenerates the
page and fails if the committed one drifts. `make demo` runs it after the labs.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from minigpt.io import atomic_write_text
from minituner.planner import default_regimes, plan, preset_shape
from minituner.planner.report import percent

ROOT = Path(__file__).resolve().parents[1]
LAB01, LAB02, LAB03 = (Path("experiments") / name for name in ("28-lora-counts", "28-lora-finetune", "28-qlora-preview"))
OUT = ROOT / "PHASE_28_REPORT.md"
MiB, GiB = 1024**2, 1024**3


def load_results(root: Path = ROOT) -> dict:
    """The inputs of the page: Lab 02's and Lab 03's results.json."""
    return {lab: json.loads((root / path / "results.json").read_text(encoding="utf-8"))
            for lab, path in (("lab02", LAB02), ("lab03", LAB03))}


def lab01_figures(vocab: int) -> dict:
    """The seed's five regimes for MiniGPT, as Lab 01 computes them."""
    result = plan(preset_shape("minigpt", vocab))
    rows = {r.regime.label: r for r in result.regimes}
    llama = plan(preset_shape("llama-7b"), default_regimes([8])).regimes[1]  # LoRA r=8 on LLaMA-7B
    return {"total": result.total_params, "rows": rows, "r8": rows["LoRA r=8"], "llama_r8": llama.ratio_vs_full}


def render(res: dict) -> str:
    l2, l3 = res["lab02"], res["lab03"]
    l1 = lab01_figures(l2["model"]["vocab_size"])
    s2 = l2["summary"]
    b, c, d, e = l3["B"], l3["C"], l3["D"], l3["E"]
    nf4 = b["schemes"][-1]
    single = sorted(b["single_linear"].values())
    median = (single[(len(single) - 1) // 2] + single[len(single) // 2]) / 2
    quadrature = math.sqrt(sum(v * v for v in single))
    n_q = l3["A"]["quantized_layers"]
    side = "within" if b["within_tolerance"] else "above"
    tot = {k: v["after_steps"]["total"] for k, v in d["rows"].items()}
    p7 = d["planner_7b"]
    saving_7b = p7["lora-fp16"]["total"] - p7["qlora-nf4"]["total"]
    full, r8, q8 = l1["rows"]["full FT"], l1["r8"], l1["rows"]["QLoRA r=8"]
    regimes = "\n".join(f"| {label} | {r.trainable_params:,} | {percent(r.ratio_vs_full)} | {r.bytes.total / MiB:.3f} |"
                        for label, r in l1["rows"].items())
    return f"""# Phase 28: LoRA and QLoRA on MiniGPT, three labs on one page

Written by `python experiments/phase28_report.py` (`make demo` runs it after the labs) from the labs' committed
results: Lab 01's figures are recomputed by the planner, Labs 02 and 03 are read from their `results.json`.
MiniGPT: d_model {l2['model']['d_model']}, {l2['model']['n_layer']} layers, vocabulary {l2['model']['vocab_size']},
{l1['total']:,} parameters. MiB = 1024² bytes, GiB = 1024³.

| lab | question | answer | details |
|---|---|---|---|
| 01 | How much does LoRA train, and how much memory does each regime need? | LoRA r=8 trains **{r8.trainable_params:,} of {l1['total']:,} parameters ({percent(r8.ratio_vs_full)})**; full FT {full.bytes.total / MiB:.3f} MiB, LoRA r=8 {r8.bytes.total / MiB:.3f} MiB, QLoRA r=8 {q8.bytes.total / MiB:.3f} MiB | [REPORT]({LAB01}/REPORT.md), [plot]({LAB01}/memory_breakdown.png) |
| 02 | Does LoRA teach the base a new domain? | forecasts val loss **{s2['val_loss_before']:.3f} → {s2['val_loss_after']:.3f}** nats/token in {s2['steps']} steps; python-docs {s2['base_domain_val_loss_before']:.3f} → {s2['base_domain_val_loss_after']:.3f} with the adapter on, {l2['disabled_val_loss']['old']:.3f} with it off | [REPORT]({LAB02}/REPORT.md), [loss curve]({LAB02}/loss_curve.png) |
| 03 | Does LoRA on an NF4 base work, and what does it save? | logits move **{b['ratio']:.2%}** (tolerance {b['tolerance']:.0%}: {'met' if b['within_tolerance'] else 'not met'}; one Linear alone: median {median:.2%}); one epoch of QLoRA: val **{nf4['val_loss']:.4f} → {c['val_loss_after']:.4f}**; live tensors **{tot['lora-fp16'] / MiB:.3f} → {tot['qlora-nf4'] / MiB:.3f} MiB** ({tot['qlora-nf4'] / tot['lora-fp16']:.2f}×); at 7B the recipe saves {saving_7b / GiB:.2f} GiB | [REPORT]({LAB03}/REPORT.md), [loss curve]({LAB03}/loss_curve.png) |

## Lab 01: parameters and memory, by arithmetic

LoRA r on every block Linear adds r·(in + out) parameters per Linear. The planner's five regimes (batch 16 × 32
tokens; activations by the seed's estimate, the same in every regime):

| regime | trainable params | ratio vs full FT | total MiB |
|---|---|---|---|
{regimes}

At this width r=8 is {percent(r8.ratio_vs_full)} of the model; at LLaMA-7B's the same rank is {percent(l1['llama_r8'])}. The counts match
`sum(p.numel())` of the instantiated models, transformers and PEFT (tests).

![memory per regime]({LAB01}/memory_breakdown.png)

## Lab 02: LoRA fine-tuning on a new domain

r = {l2['lora']['r']}, alpha = {l2['lora']['alpha']:g} on all six Linears of each block, {s2['params_trainable']:,} trainable
parameters, {s2['steps']} steps on the built-in weather forecasts. Forecast loss {s2['val_loss_before']:.3f} → {s2['val_loss_after']:.3f}
nats/token (perplexity {math.exp(s2['val_loss_before']):.1f} → {math.exp(s2['val_loss_after']):.2f}). The adapter file is
{s2['artifact_bytes']:,} bytes against the base's {s2['base_bytes']:,} ({s2['artifact_bytes'] / s2['base_bytes']:.1%}); merged into the weights it gives
{l2['merged_val_loss']:.6f}, and PEFT loading its `adapter_peft/` differs by {'(not measured)' if l2['peft_max_logit_diff'] is None else f"{l2['peft_max_logit_diff']:.1e}"} in the logits.

![Lab 02 loss]({LAB02}/loss_curve.png)

## Lab 03: QLoRA preview

- **A.** `wrap_minigpt_qlora` quantizes the {l3['A']['quantized_layers']} targeted Linears to NF4 ({l3['A']['summary']['quantized']:,}
  weights in {l3['A']['summary']['quantized_bytes']:,} bytes), then wraps each with LoRA; only the {l3['A']['summary']['trainable']:,} LoRA
  parameters train, as the planner predicts.
- **B.** Lab 02's adapter on the NF4 base: mean |logit diff| / mean |logits| = {b['ratio']:.2%}, {side} the seed's
  {b['tolerance']:.0%}: NF4 moves each weight matrix by {nf4['weight_error']:.1%} of its norm, one quantized Linear moves the
  logits by {median:.2%} (median), and the {n_q} single-Linear errors added in quadrature give {quadrature:.2%}. Our NF4 logits equal bitsandbytes'
  ({'not measured' if b['bitsandbytes_max_abs_diff'] is None else f"max diff {b['bitsandbytes_max_abs_diff']:.1e}"}); int8 stays at {b['schemes'][0]['with_adapter']['ratio']:.2%}.
- **C.** One epoch ({c['steps']} steps) of QLoRA from Lab 02's adapter, every loss finite: val {nf4['val_loss']:.4f} →
  {c['val_loss_after']:.4f} (fp base + Lab 02 adapter: {b['fp_val_loss']:.4f}).
- **D.** Live tensors after {d['steps']} steps: LoRA on an fp16 base {tot['lora-fp16']:,} bytes, QLoRA {tot['qlora-nf4']:,} bytes;
  the absolute saving at MiniGPT scale is {(tot['lora-fp16'] - tot['qlora-nf4']) / MiB:.3f} MiB; at 7B scale the same recipe
  would save {saving_7b / GiB:.2f} GiB (planner). The exact accounting is the planner's bytes plus fp32 LoRA factors.
- **E.** Both adapters on one NF4 base: finite, different outputs (val {e['adapters']['lab02']['val_loss']:.4f} vs
  {e['adapters']['qlora']['val_loss']:.4f}), the quantized base bit-identical after the swaps.

![Lab 03 loss]({LAB03}/loss_curve.png)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    atomic_write_text(args.out, render(load_results()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

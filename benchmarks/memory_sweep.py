"""The planner against measured memory: a batch x seq x rank sweep of `minituner memory-check`, with and
without gradient checkpointing.

    python benchmarks/memory_sweep.py           # writes benchmarks/memory_sweep.md and memory_sweep.png
    python benchmarks/memory_sweep.py --quick   # six small points, to check that it runs

Each point is one `minituner memory-check --json` in a fresh process (so the peak is that run's alone; a point
whose peak is under SMALL_PEAK runs REPEATS times, the run with the median peak kept) on MiniGPT (the `minigpt` preset), a GPT-2-124M-shaped model (GPT-2 small's config.json, random
weights, imported into MiniGPT) and two small llama-family shapes built as ``minigpt.decoder.Decoder``
(a llama with grouped-query attention and an untied head, a qwen2 with q/k/v biases and a tied head);
full, LoRA and QLoRA; instruction batches (some targets counted) and runs with dropout (the model's, as GPT-2
trains, and LoRA's); fp32 on CPU. `run(quick)` returns the same figures as a section of
benchmarks/RESULTS.md for benchmarks/run.py.
"""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from minigpt.io import atomic_write_bytes, atomic_write_text, write_json  # noqa: E402
from minituner.planner.activations import dropout_phrase  # noqa: E402

MIB = 2**20
GOAL = 10.0  # percent: the step's peak predicted within ±10% of the measurement
# A point whose measured peak is under SMALL_PEAK is measured REPEATS times (fresh processes) and its median run kept:
# there the process's own unmodelled bytes (Python's and autograd's objects in the heap, tensors under the pinned
# mmap threshold) move the measurement by a share the planner is not asked to track. minigpt full 8 x 64,
# checkpointed, predicted 5.82 MiB: measured 5.76-6.22 MiB over six processes, 6.64 in one bench run (AMD EPYC,
# 2026-12-07); its optimizer step, whose live tensors the planner knows exactly, measured 0.11-0.36 MiB above them.
SMALL_PEAK = 16 * MIB
REPEATS = 3
# GPT-2 small (124M) as its Hugging Face config.json says it; the weights are random.
GPT2_124M = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
# Small llama-family shapes (random weights), sized so that each run takes seconds on 2 cores: a llama with GQA
# (8 query / 2 K/V heads) and an untied head, a qwen2 (q/k/v biases) with GQA and a tied head.
LLAMA_GQA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "max_position_embeddings": 1024, "tie_word_embeddings": False}
QWEN2_BIAS = {"model_type": "qwen2", "vocab_size": 6000, "hidden_size": 192, "intermediate_size": 512,
              "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": True}
CONFIGS = {"gpt2-124m": GPT2_124M, "llama-gqa": LLAMA_GQA, "qwen2-bias": QWEN2_BIAS}  # --config files, by model
# checkpoints written in bf16 (transformers' save_pretrained, random weights) and read with --base, as finetune
# reads them: LoRA keeps their Linears, embedding and head bf16 and upcasts each per product (minituner.upcast)
CHECKPOINTS = {"llama-gqa-bf16": LLAMA_GQA}


@dataclass(frozen=True)
class Point:
    """One memory-check run; rank is ignored for full fine-tuning."""

    model: str
    regime: str
    rank: int
    batch: int
    seq: int
    grad_checkpoint: bool
    counted: int | None = None  # targets per batch that count (None: all)
    model_dropout: float = 0.0  # the model's dropout (MiniGPT, GPT-2: finetune trains GPT-2 with its config's 0.1)
    lora_dropout: float = 0.0  # finetune --dropout
    grad_accum: int = 1  # batches per step, their gradients adding up (finetune --grad-accum)


POINTS = [
    *[Point("minigpt", regime, 8, b, t, ck) for regime in ("full", "lora", "qlora") for b, t in ((8, 64), (32, 128))
      for ck in (False, True)],
    Point("minigpt", "lora", 8, 4, 32, False),  # the smallest point: ~5 MiB in all
    *[Point("minigpt", "lora", r, 16, 128, ck) for r in (4, 32) for ck in (False, True)],
    Point("gpt2-124m", "lora", 8, 1, 128, False),
    *[Point("gpt2-124m", "lora", 8, 2, 256, ck) for ck in (False, True)],
    Point("gpt2-124m", "qlora", 8, 2, 256, False),
    *[Point("gpt2-124m", "full", 8, 2, 128, ck) for ck in (False, True)],
    *[Point("llama-gqa", regime, 8, 4, 128, ck) for regime in ("full", "lora", "qlora") for ck in (False, True)],
    *[Point("llama-gqa", "lora", r, 8, 128, False) for r in (4, 32)],
    *[Point("llama-gqa", "lora", 8, 2, 512, ck) for ck in (False, True)],
    *[Point("qwen2-bias", regime, 8, 2, 256, ck) for regime in ("full", "lora", "qlora") for ck in (False, True)],
    *[Point("llama-gqa-bf16", "lora", 8, 4, 128, ck) for ck in (False, True)],
    Point("llama-gqa-bf16", "qlora", 8, 4, 128, False),
    # instruction batches: only some targets count (memory-check --counted-targets: the first positions get -100),
    # so the head and the loss run on those rows alone; the same points above count every target
    Point("gpt2-124m", "lora", 8, 2, 256, False, 128),
    Point("llama-gqa", "lora", 8, 4, 128, False, 256),
    Point("llama-gqa", "qlora", 8, 4, 128, True, 128),
    Point("qwen2-bias", "qlora", 8, 2, 256, False, 64),
    # dropout: GPT-2 as finetune trains it (its config's 0.1: masks, attention's probabilities on SDPA's math path),
    # and LoRA's (finetune --dropout); the same points above run without
    *[Point("gpt2-124m", "lora", 8, 2, 256, ck, model_dropout=0.1) for ck in (False, True)],
    Point("gpt2-124m", "full", 8, 2, 128, False, model_dropout=0.1),
    Point("gpt2-124m", "qlora", 8, 2, 256, False, model_dropout=0.1, lora_dropout=0.05),
    Point("minigpt", "lora", 8, 32, 128, True, model_dropout=0.1),
    Point("llama-gqa", "lora", 8, 4, 128, False, lora_dropout=0.1),
    Point("qwen2-bias", "qlora", 8, 2, 256, True, lora_dropout=0.1),
    # gradient accumulation: every backward after the first holds all the gradients (full FT: as many as weights);
    # the same points above run with one batch a step
    Point("gpt2-124m", "full", 8, 2, 128, False, grad_accum=3),
    Point("gpt2-124m", "lora", 8, 2, 256, False, grad_accum=3),
    Point("llama-gqa", "full", 8, 4, 128, True, grad_accum=2),
    Point("llama-gqa", "qlora", 8, 4, 128, False, grad_accum=4),
]
# the same runs with glibc's malloc left as it is: how much the resident set keeps beyond the live tensors
UNPINNED_POINTS = [Point("minigpt", "full", 8, 32, 128, False), Point("minigpt", "lora", 8, 32, 128, False),
                   Point("gpt2-124m", "lora", 8, 2, 256, False)]
QUICK_POINTS = [Point("minigpt", "full", 8, 8, 64, False), Point("minigpt", "lora", 8, 8, 64, True),
                Point("gpt2-124m", "lora", 8, 1, 64, False), Point("gpt2-124m", "lora", 8, 1, 64, False, 16),
                Point("gpt2-124m", "lora", 8, 1, 64, False, model_dropout=0.1),
                Point("llama-gqa", "qlora", 8, 2, 64, True)]


def measure(point: Point, configs: Path, pinned: bool = True) -> dict:
    """One memory-check run in a fresh process (so the peak is that run's alone); its JSON."""
    model = point.model
    source = (["--preset", "minigpt"] if model == "minigpt" else ["--base", str(configs / model)]
              if model in CHECKPOINTS else ["--config", str(configs / model / "config.json")])
    cmd = [sys.executable, "-m", "minituner", "memory-check", *source, "--regime", point.regime, "--rank",
           str(point.rank), "--batch-size", str(point.batch), "--seq-len", str(point.seq), "--device", "cpu", "--json",
           *(["--grad-checkpoint"] if point.grad_checkpoint else []), *([] if pinned else ["--default-allocator"]),
           *([] if point.counted is None else ["--counted-targets", str(point.counted)]),
           *(["--model-dropout", str(point.model_dropout)] if point.model_dropout else []),
           *(["--dropout", str(point.lora_dropout)] if point.lora_dropout else []),
           *(["--grad-accum", str(point.grad_accum)] if point.grad_accum > 1 else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout)
    result["details"]["model"] = model
    result["details"]["pinned"] = pinned
    return result


def write_checkpoint(folder: Path, config: dict) -> None:
    """A random-weight bf16 checkpoint of `config`, as transformers writes one (no tokenizer: memory-check needs none)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(torch.bfloat16)
    model.save_pretrained(folder)


def sweep(quick: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp)
        for name, config in CONFIGS.items():
            (cfg / name).mkdir()
            write_json(cfg / name / "config.json", config)
        for name, config in CHECKPOINTS.items():
            if any(p.model == name for p in (QUICK_POINTS if quick else POINTS)):
                write_checkpoint(cfg / name, config)
        results = []
        for point, pinned in [(p, True) for p in (QUICK_POINTS if quick else POINTS)] + \
                [(p, False) for p in ([] if quick else UNPINNED_POINTS)]:
            t0 = time.perf_counter()
            runs = [measure(point, cfg, pinned)]
            if pinned and runs[0]["measured"]["peak"] < SMALL_PEAK:
                runs += [measure(point, cfg, pinned) for _ in range(REPEATS - 1)]
            results.append(median_run(runs))
            print(f"[memory_sweep] {point}{'' if pinned else ' glibc default'} {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
    return results


def median_run(runs: list[dict]) -> dict:
    """The run whose measured peak is the median of the runs (the lower middle of an even count), whole, so its
    figures stay one run's; with more than one run, details["peak_runs"] holds every run's measured peak, sorted."""
    ordered = sorted(runs, key=lambda r: r["measured"]["peak"])
    kept = ordered[(len(ordered) - 1) // 2]
    if len(runs) > 1:
        kept["details"]["peak_runs"] = [r["measured"]["peak"] for r in ordered]
    return kept


def repeated(results: list[dict]) -> list[str]:
    """A sentence on the points measured more than once (median_run), their spread; [] where none was."""
    many = [r for r in results if len(r["details"].get("peak_runs", [])) > 1]
    if not many:
        return []
    spreads = "; ".join(
        f"{r['details']['model']} {label(r)} {batch_cell(r['details'])}"
        f"{', checkpointed' if r['details']['grad_checkpoint'] else ''}: "
        + " / ".join(f"{v / MIB:,.2f}" for v in r["details"]["peak_runs"])
        + f" (predicted {r['predicted']['peak'] / MIB:,.2f})" for r in many)
    return [f"Points whose peak measured under {SMALL_PEAK / MIB:g} MiB ran {REPEATS} times, each in a fresh process; "
            f"the table keeps the run with the median peak (the process's own bytes that the planner does not "
            f"model, Python's and autograd's objects and tensors under the mmap threshold in the heap, move a peak "
            f"this small by several percent from run to run). Measured peaks, MiB: {spreads}."]


def pinned(results: list[dict]) -> list[dict]:
    return [r for r in results if r["details"].get("pinned", True)]


def unpinned_table(results: list[dict]) -> list[str]:
    """The raw resident-set peak with glibc's default malloc beside the pinned run of the same point."""
    same = {point_key(r["details"]): r for r in pinned(results)}
    lines = ["| model | regime | batch × seq | peak predicted MiB | raw peak, pinned MiB | raw peak, glibc default MiB "
             "| error vs glibc default raw peak |", "|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["details"]
        if d.get("pinned", True):
            continue
        p, raw = r["predicted"]["peak"], d["peak_raw_bytes"]
        other = same.get(point_key(d))
        lines.append(f"| {d['model']} | {label(r)} | {d['batch_size']} × {d['seq_len']} | {p / MIB:,.2f} | "
                     f"{other['details']['peak_raw_bytes'] / MIB if other else float('nan'):,.2f} | {raw / MIB:,.2f} | "
                     f"{100 * (p - raw) / raw:+.1f}% |")
    return lines


def label(res: dict) -> str:
    d = res["details"]
    return d["regime"] + ("" if d["rank"] is None else f" r={d['rank']}") + dropout_cell(d)


def dropout_cell(d: dict) -> str:
    """", the model's dropout 0.1 and LoRA dropout 0.05" for a run with dropout; "" without."""
    return dropout_phrase(*dropouts(d), ", ")


def dropouts(d: dict) -> tuple[float, float]:
    return d.get("model_dropout", 0.0), d.get("lora_dropout", 0.0)


def batch_cell(d: dict) -> str:
    """batch × seq, and how many targets count when not all do."""
    every = d["batch_size"] * d["seq_len"]
    counted = d["counted_targets"]
    accum = d.get("grad_accum", 1)
    return (f"{d['batch_size']} × {d['seq_len']}" + ("" if counted == every else f", {counted:,} counted")
            + (f", {accum} a step" if accum > 1 else ""))


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "regime", "batch × seq", "grad ckpt", "weights / grads / optimizer error",
              "activations MiB", "activations error", "peak predicted MiB", "peak measured MiB", "peak error",
              "peak at (planned / measured)", "process baseline MiB", "buckets' total error (old planner)"]
    rows = []
    for res in results:
        d, p, m, e = res["details"], res["predicted"], res["measured"], res["error"]
        exact = max(abs(e[b]) for b in ("weights", "grads", "optimizer"))
        total_err = (d["buckets_total_bytes"] - m["peak"]) / m["peak"]
        rows.append([
            d["model"], label(res), batch_cell(d), "yes" if d["grad_checkpoint"] else "no",
            f"{100 * exact:.2f}%", f"{m['activations'] / MIB:,.2f}", f"{100 * e['activations']:+.2f}%",
            f"{p['peak'] / MIB:,.2f}", f"{m['peak'] / MIB:,.2f}", f"{100 * e['peak']:+.2f}%",
            f"{d['predicted_peak_phase']} / {d['measured_peak_phase']}", f"{d['baseline_bytes'] / MIB:,.1f}",
            f"{100 * total_err:+.1f}%",
        ])
    return header, rows


def by_group(results: list[dict]) -> list[list[str]]:
    """Min and max peak error per model, regime and checkpointing."""
    groups: dict[tuple, list[float]] = {}
    for res in results:
        d = res["details"]
        groups.setdefault((d["model"], d["regime"], d["grad_checkpoint"]), []).append(100 * res["error"]["peak"])
    return [[m, r, "yes" if ck else "no", str(len(v)), f"{min(v):+.2f}%", f"{max(v):+.2f}%"]
            for (m, r, ck), v in groups.items()]


def point_key(d: dict, leave_out: str | None = None) -> tuple:
    """What identifies a run's point (but for one aspect of it, when given)."""
    aspects = {"model": d["model"], "regime": d["regime"], "rank": d["rank"], "batch": (d["batch_size"], d["seq_len"]),
               "grad_checkpoint": d["grad_checkpoint"], "counted": d["counted_targets"], "dropout": dropouts(d),
               "grad_accum": d.get("grad_accum", 1)}
    aspects.pop(leave_out, None)
    return tuple(aspects.values())


def beside(results: list[dict], aspect: str, baseline) -> list[tuple[dict, dict]]:
    """(run, the same point with `aspect` as baseline(details) wants it) for each run where it is not."""
    plain = {point_key(r["details"], aspect): r for r in results if baseline(r["details"])}
    return [(r, plain[point_key(r["details"], aspect)]) for r in results
            if not baseline(r["details"]) and point_key(r["details"], aspect) in plain]


def saving(results: list[dict]) -> list[str]:
    """Measured peak with and without checkpointing, for the points swept both ways."""
    out = []
    for r, plain in beside(results, "grad_checkpoint", lambda d: not d["grad_checkpoint"]):
        before, after = plain["measured"]["peak"], r["measured"]["peak"]
        out.append(f"{r['details']['model']} {label(r)} {batch_cell(r['details'])}: {before / MIB:,.1f} → "
                   f"{after / MIB:,.1f} MiB ({100 * (after - before) / before:+.0f}%)")
    return out


def counted(results: list[dict]) -> list[str]:
    """For each instruction batch (some targets counted), the same point with every target counting: what the
    planner says and the run measures each way."""
    out = []
    for r, every in beside(results, "counted", lambda d: d["counted_targets"] == d["batch_size"] * d["seq_len"]):
        d = r["details"]
        p, m, p_all = r["predicted"]["peak"], r["measured"]["peak"], every["predicted"]["peak"]
        out.append(f"{d['model']} {label(r)} {batch_cell(d)}{', checkpointed' if d['grad_checkpoint'] else ''}: "
                   f"measured {m / MIB:,.1f} MiB (every target counting: {every['measured']['peak'] / MIB:,.1f}); "
                   f"planned for the counted rows {p / MIB:,.1f} ({100 * (p - m) / m:+.1f}%), planned as if every "
                   f"target counted {p_all / MIB:,.1f} ({100 * (p_all - m) / m:+.1f}%)")
    return out


def with_dropout(results: list[dict]) -> list[str]:
    """For each run with dropout, the same point without: what the planner says and the run measures each way."""
    out = []
    for r, plain in beside(results, "dropout", lambda d: dropouts(d) == (0.0, 0.0)):
        d = r["details"]
        p, m, p_none = r["predicted"]["peak"], r["measured"]["peak"], plain["predicted"]["peak"]
        out.append(f"{d['model']} {label(r)}, {batch_cell(d)}{', checkpointed' if d['grad_checkpoint'] else ''}: "
                   f"measured {m / MIB:,.1f} MiB (without dropout: {plain['measured']['peak'] / MIB:,.1f}); planned "
                   f"with it {p / MIB:,.1f} ({100 * (p - m) / m:+.1f}%) at the {d['predicted_peak_phase']}, as "
                   f"without it {p_none / MIB:,.1f} ({100 * (p_none - m) / m:+.1f}%)")
    return out


def accumulated(results: list[dict]) -> list[str]:
    """For each run with gradient accumulation, the same point with one batch a step: planned and measured."""
    out = []
    for r, one in beside(results, "grad_accum", lambda d: d.get("grad_accum", 1) == 1):
        d = r["details"]
        p, m = r["predicted"]["peak"], r["measured"]["peak"]
        out.append(f"{d['model']} {label(r)}, {batch_cell(d)}{', checkpointed' if d['grad_checkpoint'] else ''}: "
                   f"measured {m / MIB:,.1f} MiB (one batch a step: {one['measured']['peak'] / MIB:,.1f}); planned "
                   f"{p / MIB:,.1f} ({100 * (p - m) / m:+.1f}%) at the {d['predicted_peak_phase']}, as one batch a "
                   f"step {one['predicted']['peak'] / MIB:,.1f} ({100 * (one['predicted']['peak'] - m) / m:+.1f}%)")
    return out


def summary(results: list[dict]) -> list[str]:
    """Sentences with the extremes, every number from the results."""
    peak = [100 * r["error"]["peak"] for r in results]
    act = [100 * r["error"]["activations"] for r in results]
    exact = max(100 * abs(r["error"][b]) for r in results for b in ("weights", "grads", "optimizer"))
    old = [100 * (r["details"]["buckets_total_bytes"] - r["measured"]["peak"]) / r["measured"]["peak"] for r in results]
    base = [r["details"]["baseline_bytes"] / MIB for r in results]
    raw = [100 * (r["predicted"]["peak"] - r["details"]["peak_raw_bytes"]) / r["details"]["peak_raw_bytes"]
           for r in results]
    met = all(abs(p) <= GOAL for p in peak)
    differ = [r for r in results if r["details"]["predicted_peak_phase"].split(":")[0].split(" ")[0]
              != r["details"]["measured_peak_phase"].split(" ")[0]]
    same = len(results) - len(differ)
    where = "; ".join(f"{r['details']['model']} {label(r)} {batch_cell(r['details'])}"
                      f"{', checkpointed' if r['details']['grad_checkpoint'] else ''}: "
                      f"{r['details']['predicted_peak_phase']} / {r['details']['measured_peak_phase']}" for r in differ)
    return [
        f"Peak, planner/peak.py: errors from {min(peak):+.2f}% to {max(peak):+.2f}% over {len(results)} runs "
        f"(goal ±{GOAL:g}% at every point: {'met' if met else 'NOT met'}). The buckets' total (the planner before "
        f"its peak model) was off by {min(old):+.1f}% to {max(old):+.1f}%.",
        f"Where: the planner names the peak's phase; it agrees with the measured phase (forward, backward, optimizer "
        f"step) in {same} of {len(results)} runs" + (f" (predicted / measured where they differ: {where})." if differ else "."),
        f"Weights, grads and optimizer (Adam m, v): largest error {exact:.2f}%; activations (saved for backward, "
        f"checkpointed block inputs included): {min(act):+.2f}% to {max(act):+.2f}%.",
        f"The process's own memory (Python, libraries' buffers, allocator slack), measured before the measured steps "
        f"and shown as its own column, grew by {min(base):.1f} to {max(base):.1f} MiB since before the model was "
        f"built; against the raw resident-set peak, which includes it, the planner's peak is off by {min(raw):+.1f}% "
        f"to {max(raw):+.1f}%.",
    ]


def plot(results: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 5.6), dpi=100)
    colors = {"full": "tab:red", "lora": "tab:blue", "qlora": "tab:green"}
    markers = {"minigpt": "o", "gpt2-124m": "s", "llama-gqa": "^", "qwen2-bias": "D", "llama-gqa-bf16": "v"}
    everything = []
    for res in results:
        d = res["details"]
        x, y = res["measured"]["peak"] / MIB, res["predicted"]["peak"] / MIB
        old = d["buckets_total_bytes"] / MIB
        everything += [x, y, old]
        ck = d["grad_checkpoint"]
        ax.scatter([x], [y], marker=markers[d["model"]], s=46, edgecolors=colors[d["regime"]],
                   facecolors="none" if ck else colors[d["regime"]], alpha=0.9, zorder=3)
        ax.scatter([x], [old], marker="x", s=22, color="gray", alpha=0.6, zorder=2)
    lo, hi = min(everything) * 0.7, max(everything) * 1.4
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15)
    handles = [plt.Line2D([], [], marker=markers[m], ls="", color="black", label=m) for m in markers]
    handles += [plt.Line2D([], [], marker="o", ls="", color=c, label=r) for r, c in colors.items()]
    handles += [plt.Line2D([], [], marker="o", ls="", markerfacecolor="none", color="black", label="grad checkpoint"),
                plt.Line2D([], [], marker="x", ls="", color="gray", label="buckets' total (no peak model)"),
                plt.Line2D([], [], color="gray", lw=6, alpha=0.3, label="±10%")]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured peak of a training step (MiB, 1024²)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title("step peak: planner vs measured\n(MiniGPT, a GPT-2-124M shape, llama and qwen2 shapes; fp32 compute, CPU)",
                 fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


INTRO = ("`minituner memory-check --json` on each point (a fresh process each; points whose peak is under "
         f"{SMALL_PEAK // MIB} MiB {REPEATS} times, the run with the median peak kept): the planner's buckets and its peak "
         "model (`planner/peak.py`: what is alive at the worst phase of a step), told the run's dtypes (fp32 "
         "weights, grads, Adam and activations), beside the measurement. Peak measured: the resident set's "
         "high-water mark (VmHWM, reset per phase) over the steps after the first, with glibc's mmap threshold "
         "pinned at 16 KiB (freed tensors go back to the system, as CUDA's allocated bytes count them), above "
         "the process's own memory (RSS minus live tensors before those steps, the heap's free pages first handed "
         "back with malloc_trim; its growth since before the model "
         "was built is the baseline column). fp32 on CPU, MiB = 1024² bytes, AdamW, 2 steps, random tokens (every "
         "target counting unless the batch column says how many do; one batch a step unless it says how many), no "
         "dropout unless the regime column names it "
         "(memory-check sets the model's dropout to `--model-dropout`, 0 by default); "
         "error = (predicted − measured) / measured. Plot: `benchmarks/memory_sweep.png`. Models: `minigpt` (the preset), "
         "`gpt2-124m` (GPT-2 small's config, imported into MiniGPT), `llama-gqa` (llama: d_model 256, 4 layers, 8 query "
         "/ 2 K/V heads, SwiGLU 688, vocab 4,096, untied) and `qwen2-bias` (qwen2: d_model 192, 3 layers, 6 / 2 heads, "
         "q/k/v biases, SwiGLU 512, vocab 6,000, tied), the last two as `minigpt.decoder.Decoder` with random weights "
         "(exact model: `planner/decoder_activations.py`); `llama-gqa-bf16` is the same llama written as a bf16 "
         "checkpoint by transformers and read with `--base` as finetune reads it: LoRA and QLoRA compute in fp32 while "
         "its block Linears that are not quantized, its embedding and its head stay bf16, upcast per product into the "
         "shared workspace (the head 2,048 rows at a time).")


def markdown(results: list[dict], command: str) -> str:
    extra = unpinned_table(results)
    results = pinned(results)
    header, rows = table(results)
    lines = ["# Memory: the planner against measurement", "", f"Written by `{command}`.", "", INTRO, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Peak error per model, regime and checkpointing:", "",
              "| model | regime | grad ckpt | points | min error | max error |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in by_group(results)]
    lines += ["", "Gradient checkpointing, measured peak without → with:", ""] + [f"- {s}" for s in saving(results)]
    instruction = counted(results)
    if instruction:
        lines += ["", "Instruction batches (some targets counted; memory-check `--counted-targets`, the first positions "
                  "of the batch -100): the head and the loss run on the counted rows, and the planner plans them "
                  "(`count --data` finds the largest such batch of a data set); beside them the same point with "
                  "every target counting:", ""] + [f"- {s}" for s in instruction]
    dropped = with_dropout(results)
    if dropped:
        lines += ["", "Dropout (memory-check `--model-dropout`: the model's, as finetune trains GPT-2 with its "
                  "config's 0.1; `--dropout`: LoRA's, as finetune's `--dropout`): masks, and attention on SDPA's math "
                  "path with its (B, h, T, T) probabilities; beside each, the same point without dropout:", ""] + \
            [f"- {s}" for s in dropped]
    accumulating = accumulated(results)
    if accumulating:
        lines += ["", "Gradient accumulation (memory-check `--grad-accum N`, as finetune's: N batches a step, their "
                  "gradients adding up): every backward after the first holds all the gradients, added into; beside "
                  "each, the same point with one batch a step:", ""] + [f"- {s}" for s in accumulating]
    lines += [""] + [f"- {s}" for s in summary(results) + repeated(results)]
    if len(extra) > 2:
        lines += ["", "With glibc's malloc left as it is (`--default-allocator`, what a plain training process gets), "
                  "the resident set keeps freed tensors of earlier steps (glibc raises its mmap threshold after the "
                  "first frees, then serves the next step's tensors from a heap it does not give back): the raw "
                  "peak above the pre-build process, for the same points:", "", *extra]
    lines += ["", "![predicted vs measured](memory_sweep.png)", ""]
    return "\n".join(lines)


def run(quick: bool = False):
    """A section of benchmarks/RESULTS.md (benchmarks/run.py); also writes memory_sweep.md/.png."""
    from report import Goal, Section

    results = sweep(quick)
    write(results, "python benchmarks/memory_sweep.py" + (" --quick" if quick else ""))
    results = pinned(results)
    header, rows = table(results)
    ratios = [r["predicted"]["peak"] / r["measured"]["peak"] for r in results]
    goals = [Goal("peak: largest predicted / measured", max(ratios), 1 + GOAL / 100, False, "planner/peak.py"),
             Goal("peak: smallest predicted / measured", min(ratios), 1 - GOAL / 100, True, "planner/peak.py")]
    intro = INTRO + "\n\n![predicted vs measured peak](memory_sweep.png)"
    return Section("Memory: the planner against measurement", intro, header, rows, goals,
                   summary(results) + repeated(results) + counted(results) + with_dropout(results)
                   + accumulated(results))


def write(results: list[dict], command: str) -> None:
    atomic_write_text(HERE / "memory_sweep.md", markdown(results, command))
    atomic_write_bytes(HERE / "memory_sweep.png", plot(pinned(results)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="six small points")
    args = parser.parse_args(argv)
    results = sweep(args.quick)
    write(results, "python benchmarks/memory_sweep.py" + (" --quick" if args.quick else ""))
    print((HERE / "memory_sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

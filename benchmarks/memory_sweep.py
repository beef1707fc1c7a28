"""The planner against measured memory: a batch x seq sweep of `minituner memory-check`.

    python benchmarks/memory_sweep.py           # writes benchmarks/memory_sweep.md and memory_sweep.png
    python benchmarks/memory_sweep.py --quick   # three small points, to check that it runs

Each point is one `minituner memory-check --json` in a fresh process (so the peak is that run's alone)
on MiniGPT (the `minigpt` preset) and on a GPT-2-124M-shaped model (GPT-2 small's config.json, random
weights, imported into MiniGPT), fp32 on CPU. `run(quick)` returns the same figures as a section of
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from minigpt.io import atomic_write_bytes, atomic_write_text, write_json  # noqa: E402

MIB = 2**20
GOAL = 10.0  # percent: activations predicted within ±10% of the measurement
# GPT-2 small (124M) as its Hugging Face config.json says it; the weights are random.
GPT2_124M = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
# (model, regime, batch, seq)
POINTS = [
    *[("minigpt", regime, b, t) for regime in ("full", "lora") for b, t in ((4, 32), (16, 64), (32, 128))],
    ("minigpt", "qlora", 16, 64),
    *[("gpt2-124m", "lora", b, t) for b, t in ((1, 128), (2, 256), (4, 256))],
    ("gpt2-124m", "full", 2, 128),
]
QUICK_POINTS = [("minigpt", "full", 4, 32), ("minigpt", "lora", 4, 32), ("gpt2-124m", "lora", 1, 64)]


def measure(model: str, regime: str, batch: int, seq: int, gpt2_config: Path) -> dict:
    """One memory-check run in a fresh process; its JSON."""
    source = ["--preset", "minigpt"] if model == "minigpt" else ["--config", str(gpt2_config)]
    cmd = [sys.executable, "-m", "minituner", "memory-check", *source, "--regime", regime, "--batch-size", str(batch),
           "--seq-len", str(seq), "--device", "cpu", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout)
    result["model"] = model
    return result


def sweep(quick: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        write_json(cfg, GPT2_124M)
        results = []
        for point in QUICK_POINTS if quick else POINTS:
            t0 = time.perf_counter()
            results.append(measure(*point, cfg))
            print(f"[memory_sweep] {point} {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return results


def rows_by_bucket(result: dict) -> dict[str, dict]:
    return {r["bucket"]: r for r in result["rows"]}


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "regime", "batch × seq", "weights / grads / optimizer error", "activations predicted MiB",
              "activations measured MiB", "error", "seed estimate error", "Korthikanti error",
              "peak measured MiB", "planner total MiB"]
    rows = []
    for res in results:
        r = rows_by_bucket(res)
        exact = max(abs(r[b]["error_percent"]) for b in ("weights", "grads", "optimizer"))
        act = r["activations"]
        rows.append([
            res["model"], res["regime"] + ("" if res["rank"] is None else f" r={res['rank']}"),
            f"{res['batch_size']} × {res['seq_len']}", f"{exact:.2f}%",
            f"{act['predicted_bytes'] / MIB:,.2f}", f"{act['measured_bytes'] / MIB:,.2f}", f"{act['error_percent']:+.2f}%",
            f"{r['activations, seed estimate']['error_percent']:+.1f}%",
            f"{r['activations, korthikanti estimate']['error_percent']:+.1f}%",
            f"{r['peak (planner total)']['measured_bytes'] / MIB:,.1f}",
            f"{r['peak (planner total)']['predicted_bytes'] / MIB:,.1f}",
        ])
    return header, rows


def summary(results: list[dict]) -> list[str]:
    """Sentences with the extremes, every number from the results."""
    act = [rows_by_bucket(r)["activations"]["error_percent"] for r in results]
    seed = [rows_by_bucket(r)["activations, seed estimate"]["error_percent"] for r in results]
    kor = [rows_by_bucket(r)["activations, korthikanti estimate"]["error_percent"] for r in results]
    exact = max(abs(rows_by_bucket(r)[b]["error_percent"]) for r in results for b in ("weights", "grads", "optimizer"))
    peak = [rows_by_bucket(r)["peak (planner total)"]["error_percent"] for r in results]
    met = all(abs(a) <= GOAL for a in act)
    return [
        f"Weights, grads and optimizer (Adam m, v): largest error {exact:.2f}% over {len(results)} runs (exact).",
        f"Activations, exact model: errors from {min(act):+.2f}% to {max(act):+.2f}% "
        f"(goal ±{GOAL:g}%: {'met' if met else 'NOT met'}).",
        f"The seed's estimate (batch·seq·d_model·n_layer·16 bytes) is off by {min(seed):+.1f}% to {max(seed):+.1f}%: "
        "per token and layer it allows 16·d_model bytes where an fp32 MiniGPT block keeps 8·d_model + 2·d_ff "
        "= 16·d_model elements, 64·d_model bytes (ln_1/ln_2 inputs and outputs, q, k, v, the attention output; "
        "fc1's and GELU's outputs of d_ff each), and it leaves out the logits' log-softmax "
        "(batch·seq·vocab·4 bytes, large for GPT-2's 50,257 tokens).",
        f"Korthikanti et al.'s 34·sbh + 5·as²b (fp16, attention scores stored) is off by {min(kor):+.1f}% to "
        f"{max(kor):+.1f}%: it assumes 2-byte activations and stored h·seq² attention scores (our fused "
        "attention keeps one logsumexp per query and head instead) and leaves out the logits.",
        f"Peak process memory (resident set on CPU, during the steps, above the pre-build baseline) against the "
        f"planner's total: {min(peak):+.1f}% to {max(peak):+.1f}% — the planner has no model of transients "
        "(logit gradients, the base layers' outputs LoRA adds to, glibc keeping freed memory).",
    ]


def plot(results: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=100)
    styles = {"exact model": ("o", "tab:blue", "activations"), "seed estimate": ("v", "tab:red", "activations, seed estimate"),
              "Korthikanti": ("s", "tab:orange", "activations, korthikanti estimate")}
    everything = []
    for label, (marker, color, key) in styles.items():
        xs = [rows_by_bucket(r)[key]["measured_bytes"] / MIB for r in results]
        ys = [rows_by_bucket(r)[key]["predicted_bytes"] / MIB for r in results]
        everything += xs + ys
        ax.scatter(xs, ys, marker=marker, color=color, label=label, alpha=0.85)
    lo, hi = min(everything) * 0.7, max(everything) * 1.4
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured: bytes saved for backward (MiB, 1024²)")
    ax.set_ylabel("predicted (MiB)")
    ax.set_title("activations: planner vs measured\n(MiniGPT and a GPT-2-124M shape, fp32, CPU)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


INTRO = ("`minituner memory-check` on each point: the planner's buckets (told the run's dtypes: fp32 weights, "
         "grads, Adam and activations; the exact MiniGPT activation model of `planner/activations.py`) beside "
         "the measurement (tensors held by model and optimizer; bytes autograd saves for backward, each storage "
         "once; the resident-set peak). fp32 on CPU, MiB = 1024² bytes, AdamW, 2 steps, random tokens; "
         "error = (predicted − measured) / measured. Plot: `benchmarks/memory_sweep.png`.")


def markdown(results: list[dict], command: str) -> str:
    header, rows = table(results)
    lines = ["# Memory: the planner against measurement", "", f"Written by `{command}`.", "", INTRO, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {s}" for s in summary(results)] + ["", "![predicted vs measured](memory_sweep.png)", ""]
    return "\n".join(lines)


def run(quick: bool = False):
    """A section of benchmarks/RESULTS.md (benchmarks/run.py); also writes memory_sweep.md/.png."""
    from report import Goal, Section

    results = sweep(quick)
    write(results, "python benchmarks/memory_sweep.py" + (" --quick" if quick else ""))
    header, rows = table(results)
    act = [rows_by_bucket(r)["activations"] for r in results]
    ratios = [a["predicted_bytes"] / a["measured_bytes"] for a in act]
    goals = [Goal("activations: largest predicted / measured", max(ratios), 1 + GOAL / 100, False, "exact model"),
             Goal("activations: smallest predicted / measured", min(ratios), 1 - GOAL / 100, True, "exact model")]
    intro = INTRO + "\n\n![predicted vs measured activations](memory_sweep.png)"
    return Section("Memory: the planner against measurement", intro, header, rows, goals, summary(results))


def write(results: list[dict], command: str) -> None:
    atomic_write_text(HERE / "memory_sweep.md", markdown(results, command))
    atomic_write_bytes(HERE / "memory_sweep.png", plot(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small points")
    args = parser.parse_args(argv)
    results = sweep(args.quick)
    write(results, "python benchmarks/memory_sweep.py" + (" --quick" if args.quick else ""))
    print((HERE / "memory_sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

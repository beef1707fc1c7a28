"""memory_breakdown.png: one stacked bar per regime (weights / grads / optimizer / activations), MiB."""
from __future__ import annotations

import io
from pathlib import Path

from minigpt.io import atomic_write_bytes

from .memory import Plan
from .report import UNITS

BUCKETS = (("weights", "weights"), ("grads", "grads"), ("optimizer", "optimizer (Adam m, v; + fp32 master in full FT)"),
           ("activations", "activations"))
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3")


def plot_memory_breakdown(plan: Plan, path: str | Path, title: str | None = None) -> None:
    """Stacked bars in MiB (1024-based), written atomically; PNG metadata is fixed so reruns match."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = UNITS["MiB"]
    labels = [r.regime.label for r in plan.regimes]
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    bottoms = [0.0] * len(plan.regimes)
    for (key, legend), color in zip(BUCKETS, COLORS):
        values = [getattr(r.bytes, key) / mib for r in plan.regimes]
        ax.bar(labels, values, bottom=bottoms, color=color, label=legend, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.2f} MiB", (x, total), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("memory (MiB, 1 MiB = 1024² bytes)")
    ax.set_ylim(0, max(bottoms) * 1.3)
    ax.set_title(title or f"{plan.shape.name}: memory per regime")
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper right")  # same order as the stack
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())

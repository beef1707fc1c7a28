"""The memory planner on LLaMA-70B: arithmetic only, so it should take milliseconds."""
from __future__ import annotations

from minituner.planner import default_regimes, plan, preset_shape
from report import Section
from timing import fmt_seconds, time_call

MILLISECONDS = 0.1  # "milliseconds": a plan should take well under 100 ms


def run(quick: bool = False) -> Section:
    regimes = default_regimes([8, 16])

    def full_plan():
        return plan(preset_shape("llama-70b"), regimes, "all-linear")

    t = time_call(full_plan, repeats=11 if quick else 51, warmup=3)
    p = full_plan()
    section = Section(
        "Planner on LLaMA-70B",
        "`plan(preset_shape('llama-70b'), default_regimes([8, 16]), 'all-linear')`: the shape from the config, "
        "exact counts and the memory of full FT, LoRA r=8/16 and QLoRA r=8/16, no model built.",
        ["what", "median", "first call", "total params", "regimes"],
        rows=[["plan LLaMA-70B", t.fmt(), fmt_seconds(t.first_s), f"{p.total_params:,}", str(len(p.regimes))]],
    )
    section.notes.append(
        f"milliseconds: {'yes' if t.median_s < MILLISECONDS else 'no'} (median {t.fmt()}, "
        f"first call {fmt_seconds(t.first_s)})"
    )
    return section

"""Sections, goals and the Markdown of benchmarks/RESULTS.md."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Goal:
    name: str  # what is compared, e.g. "NF4 quantize fp32: bitsandbytes / ours"
    measured: float | None  # the ratio measured in this run (None: not measured, for want of the hardware)
    target: float
    higher_is_better: bool  # True: measured >= target meets the goal
    limit: str  # what limits the figure (printed whether met or not)
    measurable: bool = True  # False: this machine cannot test the goal (e.g. bf16 goals on a CPU without bf16 units)

    @property
    def met(self) -> bool:
        if not self.measurable:
            return False
        return self.measured >= self.target if self.higher_is_better else self.measured <= self.target

    def met_text(self) -> str:
        return "not measurable here" if not self.measurable else "yes" if self.met else "**no**"

    def target_text(self) -> str:
        return f"{'≥' if self.higher_is_better else '≤'} {self.target:g}×"


@dataclass
class Section:
    title: str
    intro: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render(machine: list[str], sections: list[Section], command: str, wall_s: float) -> str:
    goals = [g for s in sections for g in s.goals]
    met = sum(g.met for g in goals)
    unmeasurable = sum(not g.measurable for g in goals)
    heading = f"## Goals: {met} of {len(goals) - unmeasurable} met" + (
        f" ({unmeasurable} not measurable on this machine)" if unmeasurable else "")
    out = [
        "# Benchmarks",
        "",
        f"Written by `{command}` (`make bench`) in {wall_s / 60:.1f} min. Every figure below is printed by",
        "that run; ratios compare medians measured side by side in the same run (interleaved rounds,",
        "after warm-up; the first call is reported separately). Memory is in MiB (1024² bytes).",
        "",
        "## Machine",
        "",
        *machine,
        "",
        heading,
        "",
        *_table(
            ["goal", "target", "measured", "met", "what limits it"],
            [[g.name, g.target_text(), "–" if g.measured is None else f"{g.measured:.2f}×", g.met_text(), g.limit]
             for g in goals],
        ),
    ]
    for s in sections:
        out += ["", f"## {s.title}", "", s.intro, "", *_table(s.header, s.rows)]
        if s.notes:
            out += [""] + [f"- {n}" for n in s.notes]
    return "\n".join(out) + "\n"

"""`make bench`: run every benchmark side by side and write benchmarks/RESULTS.md (and, for a full run, the same
text to benchmarks/results/<machine kind>.md, the latest full run on each kind of machine). Its machine section
names the code it measured and the code each other kind's kept report ran (``provenance``).

    python benchmarks/run.py                     # everything (about 10 minutes on 2 cores, + bf16's Llama-1B
                                                 #   shape: about 8, + real_models: about an hour, the 7B shape
                                                 #   most of it)
    python benchmarks/run.py --only nf4,planner  # some sections; RESULTS.md then holds only those
    python benchmarks/run.py --quick             # fewer repeats, to check that it runs
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from minigpt.io import atomic_write_text  # noqa: E402
from provenance import code_line, kept_run  # noqa: E402
from report import render  # noqa: E402
from timing import fmt_seconds, machine_description, machine_kind, wait_for_quiet  # noqa: E402

# section name -> module; the order of RESULTS.md
SECTIONS = {
    "nf4": "bench_nf4",
    "step": "bench_step",
    "bf16": "bench_bf16",  # bf16 LoRA/QLoRA steps against PEFT + bitsandbytes and the matrix-product floor (issue 13)
    "lora_forward": "bench_lora_forward",
    "generate": "bench_generate",  # generation with and without the KV cache, beside transformers' generate
    "counted_loss": "bench_counted_loss",  # instruction data: the head on the counted targets alone
    "planner": "bench_planner",
    "memory": "memory_sweep",  # the planner's buckets against memory-check measurements (issue 7)
    "real_models": "bench_real_models",  # Llama-3.2-1B / Llama-2-7B shapes vs PEFT + bitsandbytes (issue 12)
}
RESULTS = HERE / "RESULTS.md"  # the latest run
BY_MACHINE = HERE / "results"  # the latest full run on each kind of machine (timing.machine_kind), kept side by side:
# machines differ from session to session (bf16 units or none), and one kind's run should not erase another's
# worth waiting for a quiet machine (the planner takes µs)
TIMING_SENSITIVE = {"nf4", "step", "bf16", "lora_forward", "generate", "counted_loss", "real_models"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run; figures are noisier)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the report (default RESULTS.md; a full run there is also kept as results/<machine>.md)")
    parser.add_argument("--max-wait", type=float, default=300.0,
                        help="seconds to wait in all for other processes to leave the CPUs idle (0: never wait)")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        print(f"error: unknown section(s) {unknown}; valid: {list(SECTIONS)}", file=sys.stderr)
        return 2
    machine = machine_description()  # before the run: the load average says how busy the machine was
    full = set(chosen) == set(SECTIONS) and not args.quick and args.out.resolve() == RESULTS.resolve()
    kind = machine_kind()
    others = sorted(p for p in BY_MACHINE.glob("*.md") if p.stem != kind) if BY_MACHINE.is_dir() else []
    machine.append(code_line(HERE.parent))
    machine.append(f"- Machine kind: {kind}" + (f"; this run is also results/{kind}.md" if full else "")
                   + (f"; the latest full runs on other kinds: {', '.join(kept_run(o, HERE.parent) for o in others)}"
                      if others else ""))
    start = time.perf_counter()
    sections = []
    wait_left = args.max_wait
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    for name in SECTIONS:
        if name not in chosen:
            continue
        busy, waited = wait_for_quiet(max(0.0, wait_left) if name in TIMING_SENSITIVE else 0.0, log=log)
        wait_left -= waited
        t0 = time.perf_counter()
        log(f"[bench] {name} ...")
        made = importlib.import_module(SECTIONS[name]).run(quick=args.quick)  # a Section, or a list (one per shape)
        made = made if isinstance(made, list) else [made]
        made[0].intro += (f" When this section started, the whole machine's CPU use was {busy:.0f}% "
                          f"(after waiting {waited:.0f} s for other processes).")
        sections += made
        log(f"[bench] {name} done in {fmt_seconds(time.perf_counter() - t0)}")
    command = "python benchmarks/run.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    text = render(machine, sections, command.strip(), time.perf_counter() - start)
    atomic_write_text(args.out, text)
    if full:
        BY_MACHINE.mkdir(exist_ok=True)
        atomic_write_text(BY_MACHINE / f"{kind}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

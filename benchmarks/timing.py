"""Timing, memory and machine description shared by the benchmarks.

Every goal is a ratio of two medians measured in the same run. Contenders are timed interleaved
(round after round, each called once per round), so a noisy shared machine slows both sides of a
ratio alike. The first (cold) call is timed separately and never enters a median. Timings are never
asserted in tests.
"""
from __future__ import annotations

import os
import platform
import re
import resource
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import psutil
import torch

MIB = 2**20
OPTIMIZER_NOTE = ("AdamW fused (torch.optim.AdamW(fused=True), torch's defaults: betas (0.9, 0.999), weight decay "
                  "0.01) for every row: the kernel minigpt.train.adamw runs (it trains with betas (0.9, 0.95) and the "
                  "run's weight decay, the same work), and transformers' Trainer's default optimizer on torch >= 2.8 "
                  "(adamw_torch_fused)")


def adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """The optimizer of every benchmarked step, ours and the reference's alike (OPTIMIZER_NOTE)."""
    return torch.optim.AdamW(params, lr=lr, fused=True)


@dataclass
class Timing:
    median_s: float
    min_s: float
    repeats: int
    first_s: float  # the first (cold) call, before warm-up

    def fmt(self) -> str:
        return fmt_seconds(self.median_s)


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_ratio(r: float) -> str:
    return f"{r:.1f}×" if r >= 10 else f"{r:.2f}×"


def per_turn_ratio(a: list[float], b: list[float]) -> str:
    """a / b turn by turn, for two contenders timed in the same turns (paced.run_paced, time_interleaved: turn i
    times each once, within seconds of each other), as "median r, from lo to hi over n turns". A slow phase of a
    shared machine that spans several turns moves both medians but not the turns' ratios, so this figure beside
    a goal's ratio of medians shows how much of that ratio is the machine's pace."""
    if len(a) != len(b) or not a:
        raise ValueError(f"per_turn_ratio needs two equal, non-empty lists of times, got {len(a)} and {len(b)}")
    ratios = sorted(x / y for x, y in zip(a, b))
    return (f"median {fmt_ratio(statistics.median(ratios))}, from {fmt_ratio(ratios[0])} to {fmt_ratio(ratios[-1])} "
            f"over {len(ratios)} turns")


def time_call(fn: Callable[[], object], repeats: int = 7, warmup: int = 2, min_total_s: float = 0.0) -> Timing:
    """Median wall time of fn() after warm-up calls (the first call is reported separately)."""
    return time_interleaved({"fn": fn}, repeats, warmup, min_total_s)["fn"]


def time_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2, min_total_s: float = 0.0,
    settle: int = 0,
) -> dict[str, Timing]:
    """Median wall time of each fn, called once per round in rotating order, after warm-up rounds.

    Round i starts with fn number i mod len(fns), so no contender always runs first (cache state,
    frequency) or last. Runs at least `repeats` rounds, more (up to 10x) until `min_total_s` is spent.
    `settle` untimed calls of a fn come right before each timed one, so that the timed call follows its own
    (as a training step follows the last one) rather than another contender's, whose caches and freed
    memory it would otherwise inherit.
    """
    names = list(fns)
    first: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        fns[name]()
        first[name] = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds = 0
    while rounds < repeats or (sum(times[names[0]]) < min_total_s and rounds < 10 * repeats):
        for k in range(len(names)):
            name = names[(rounds + k) % len(names)]
            for _ in range(settle):
                fns[name]()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {n: Timing(statistics.median(times[n]), min(times[n]), rounds, first[n]) for n in names}


def package_versions(names=("torch", "numpy", "bitsandbytes", "peft", "transformers", "torchao")) -> list[str]:
    out = []
    for name in names:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what decides bf16 and NF4 kernel speed


def cpu_flags() -> dict[str, bool]:
    """Which of CPU_FLAGS this CPU has (minigpt.bf16_support reads /proc/cpuinfo; all False where it cannot)."""
    from minigpt.bf16_support import cpu_flags as read_flags

    have = read_flags()
    return {f: f in have for f in CPU_FLAGS}


def cpu_summary() -> str:
    """'AMD EPYC; avx512_bf16 yes, amx_bf16 no, ...': the CPU model and the flags a bf16 ratio depends on."""
    return f"{_cpu_name()}; " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu_flags().items())


def machine_kind() -> str:
    """A file-name key for the kind of CPU a result depends on: its model and its widest matrix units, e.g.
    'amd-epyc_avx512-bf16' or 'amd-epyc_avx2' (benchmarks/results/ keeps the latest full run of each)."""
    name = re.sub(r"[^a-z0-9]+", "-", _cpu_name().lower()).strip("-") or "cpu"
    flags = cpu_flags()
    units = next((label for flag, label in (("amx_bf16", "amx-bf16"), ("avx512_bf16", "avx512-bf16"),
                                            ("avx512f", "avx512"), ("avx2", "avx2")) if flags.get(flag)), "no-avx2")
    return f"{name}_{units}"


def machine_description() -> list[str]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return [
        f"- CPU: {_cpu_name()}; {os.cpu_count()} logical cores visible, torch threads {torch.get_num_threads()}",
        "- CPU flags: " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu_flags().items()),
        f"- Memory: {psutil.virtual_memory().total / 2**30:.1f} GiB; {platform.system()} {platform.release()}; "
        f"transparent huge pages: {_read('/sys/kernel/mm/transparent_hugepage/enabled')}",
        f"- Python {platform.python_version()}; " + ", ".join(package_versions()),
        f"- CUDA available: {torch.cuda.is_available()} (every figure here is CPU)",
        f"- Load average when the run started: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min); "
        "other processes on the machine slow both sides of a ratio, not always equally",
    ]


# ---- memory -------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_mib() -> float:
    return psutil.Process().memory_info().rss / MIB


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux: /proc/self/clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident set size since the last reset_peak_rss() (or process start), MiB."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- a shared machine ---------------------------------------------------------------------------


def busy_percent(seconds: float = 2.0) -> float:
    """CPU use of the whole machine over `seconds` (percent of all cores), sampled while this process idles."""
    return psutil.cpu_percent(interval=seconds)


def wait_for_quiet(max_wait_s: float, threshold: float = 20.0, log=print) -> tuple[float, float]:
    """Wait (up to max_wait_s) until other processes use less than `threshold` % of the CPUs.

    Returns (busy percent when we stopped waiting, seconds waited). Other work on a 2-core machine
    slows both sides of a ratio, but not equally: a parallel region waits for its slowest thread.
    """
    t0 = time.perf_counter()
    busy = busy_percent()
    while busy >= threshold and time.perf_counter() - t0 < max_wait_s:
        log(f"[bench] other processes use {busy:.0f}% of the CPUs; waiting for them (up to {max_wait_s:.0f} s)")
        time.sleep(10)
        busy = busy_percent()
    return busy, time.perf_counter() - t0


def our_fp32_library() -> str:
    """The library minikernels.fp32_gemm chose for our fp32 products on this machine."""
    from minikernels import fp32_gemm

    return "oneDNN" if fp32_gemm.backend() == "onednn" else "PyTorch's F.linear"


def fp32_product_libraries() -> str:
    """Which library computes each side's fp32 products on this machine (minikernels.fp32_gemm chooses ours)."""
    return (f"ours through {our_fp32_library()}, which minikernels.fp32_gemm chose for this CPU, theirs through "
            "PyTorch's F.linear")


def bf16_product_libraries() -> str:
    """Which code computes each side's bf16 products on this machine: PyTorch's (oneDNN) for theirs; for ours
    oneDNN too, but for the NF4 input gradients miniquant.nf4_matmul runs in C (a CPU with AVX512-BF16, no AMX) and
    the NF4 weights miniquant.nf4_amx takes (a CPU with AMX)."""
    from miniquant import nf4_amx, nf4_matmul

    ours = "through oneDNN"
    if nf4_matmul.chosen():
        ours += (", but for its NF4 weights' input gradients, which miniquant.nf4_matmul computes in C with the codes "
                 "unpacked inside the product")
    elif nf4_amx.usable():
        ours += (f", but for the products of NF4 weights of at most {nf4_amx.MAX_WEIGHT:,} values (the K/V "
                 "projections of a Llama), which miniquant.nf4_amx computes on AMX's tiles in a GEMM of its own")
    return f"ours {ours}; theirs through oneDNN, PyTorch's bf16 products on CPU"

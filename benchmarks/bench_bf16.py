"""bf16 training steps (issue 13): ours (use_bf16_compute) against PEFT + bitsandbytes under CPU autocast, and the floor.

For each model shape (SHAPES: a builder of the float base model plus its batch; the GPT-shaped stack of
bench_step.py here, a Llama-1B shape plugs in as one more entry) and each configuration (CONFIGS), one
subprocess builds the model, warms up, times optimizer steps and profiles one more step. Rows: our LoRA and
QLoRA in fp32 and in bf16, PEFT + bitsandbytes QLoRA in fp32 and with compute_dtype bf16 under
torch.autocast (its best CPU setting). Every configuration starts from the same weights and batch.

The floor: one step of our QLoRA bf16 runs under a TorchDispatchMode that records every matrix product
(aten::mm, addmm, addmm_, bmm, baddbmm) with its shapes, strides and dtypes; each distinct product is then
timed alone (random inputs of the same layout, after warm-up) and the floor is the sum over the step's
products of their medians. Attention's fused CPU kernel is not a matrix product: it is reported apart.
On a CPU without bf16 units (minigpt.bf16_support) the bf16 goals are reported as not measurable here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_step  # noqa: E402
from minigpt.bf16_support import bf16_support  # noqa: E402
from minigpt.model import MiniGPT  # noqa: E402
from report import Goal, Section  # noqa: E402
from timing import fmt_ratio, fmt_seconds, wait_for_quiet  # noqa: E402

VS_PEFT_BNB_GOAL = 0.5  # our QLoRA bf16 step / PEFT + bitsandbytes bf16 (autocast) step
VS_FLOOR_GOAL = 1.3  # our QLoRA bf16 step / the sum of its matrix products timed alone
VS_LORA_GOAL = 1.10  # our QLoRA bf16 step / our LoRA bf16 step
WAIT_PER_CONFIG_S = 60.0
LR = 1e-4


@dataclass(frozen=True)
class Shape:
    """A model shape to benchmark: how to build its float base (seeded by the caller) and its batch."""

    describe: str  # one line for the report
    build: Callable[[], nn.Module]  # a float32 base model; forward(idx (B, T)) -> logits (B, T, V)
    vocab: int
    batch: int
    seq: int
    targets: tuple[str, ...]  # LoRA (and NF4) targets
    rank: int = 8
    alpha: float = 16.0


SHAPES: dict[str, Shape] = {
    "gpt": Shape(
        f"MiniGPT d_model {bench_step.STACK.d_model}, {bench_step.STACK.n_layer} layers, {bench_step.STACK.n_head} "
        f"heads, vocab {bench_step.STACK.vocab_size}; batch {bench_step.BATCH} × {bench_step.STACK.block_size} tokens",
        lambda: MiniGPT(bench_step.STACK), bench_step.STACK.vocab_size, bench_step.BATCH, bench_step.STACK.block_size,
        tuple(bench_step.TARGETS)),
}

# name -> label, in the order of the table (and of the first round)
CONFIGS = {
    "lora_fp32": "ours, LoRA fp32",
    "qlora_fp32": "ours, QLoRA fp32",
    "peft_bnb_fp32": "PEFT + bitsandbytes QLoRA, fp32",
    "lora_bf16": "ours, LoRA bf16 (use_bf16_compute)",
    "qlora_bf16": "ours, QLoRA bf16 (use_bf16_compute)",
    "peft_bnb_bf16": "PEFT + bitsandbytes QLoRA, compute_dtype bf16 under CPU autocast",
}


# ---- inside the subprocess ----------------------------------------------------------------------


def build(shape: Shape, config: str) -> nn.Module:
    """The model of one configuration, only its LoRA factors requiring grad."""
    from minituner.lora import LoRAConfig, apply_lora
    from minituner.precision import use_bf16_compute
    from minituner.qlora import wrap_minigpt_qlora

    torch.manual_seed(0)
    model = shape.build()
    if config.startswith("lora"):
        apply_lora(model, LoRAConfig(r=shape.rank, alpha=shape.alpha, target_modules=list(shape.targets)))
    elif config.startswith("qlora"):
        wrap_minigpt_qlora(model, r=shape.rank, alpha=shape.alpha, targets=list(shape.targets), device="cpu",
                           compute_dtype=torch.float32)
    elif config.startswith("peft_bnb"):
        from peft import LoraConfig, get_peft_model

        dtype = torch.bfloat16 if config.endswith("bf16") else torch.float32
        for path in [n for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in shape.targets]:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, bench_step._bnb_linear4bit(model.get_submodule(path), dtype))
        model = get_peft_model(model, LoraConfig(r=shape.rank, lora_alpha=shape.alpha,
                                                 target_modules=list(shape.targets), lora_dropout=0.0))
    else:
        raise ValueError(f"unknown configuration {config!r}; valid: {list(CONFIGS)}")
    if config in ("lora_bf16", "qlora_bf16"):
        use_bf16_compute(model)
    return model


MM_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")


def _spec(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), str(a.dtype).removeprefix("torch."))
    return a


def record_products(step: Callable[[], object]) -> Counter:
    """Run step() once, counting each distinct matrix product (op, argument layouts) it dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = {getattr(torch.ops.aten, name).default: name for name in MM_OPS}
    calls: Counter = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                calls[(ops[func], tuple(_spec(a) for a in args), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))] += 1
            return func(*args, **kwargs)

    with Record():
        step()
    return calls


def _materialize(spec):
    if not (isinstance(spec, tuple) and spec and spec[0] == "tensor"):
        return spec
    _, shape, stride, dtype = spec
    storage = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return (torch.randn(storage) * 0.05).to(getattr(torch, dtype)).as_strided(shape, stride)


def time_products(calls: Counter, repeats: int = 7) -> tuple[float, dict[str, float]]:
    """Sum over the recorded products of count × median time of that product alone; and the sum by op."""
    total, by_op = 0.0, Counter()
    for (op, args, kwargs), count in calls.items():
        fn, a, kw = getattr(torch.ops.aten, op).default, [_materialize(s) for s in args], {k: _materialize(v) for k, v in kwargs}
        for _ in range(2):
            fn(*a, **kw)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*a, **kw)
            times.append(time.perf_counter() - t0)
        total += count * statistics.median(times)
        by_op[op] += count * statistics.median(times)
    return total, dict(by_op)


PROFILE_GROUPS = {  # profiler op name -> group, for "what the rest of the step is"
    "aten::mm": "matrix products", "aten::addmm": "matrix products", "aten::addmm_": "matrix products",
    "aten::bmm": "matrix products", "aten::baddbmm": "matrix products",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention kernel (fp32)",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention kernel (fp32)",
    "aten::copy_": "dtype casts and copies",
}


def profile_groups(step: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """(wall seconds of one profiled step, self CPU seconds by group); everything unlisted is 'other'."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    groups: Counter = Counter()
    for e in prof.key_averages():
        groups[PROFILE_GROUPS.get(e.key, "other")] += e.self_cpu_time_total / 1e6
    return wall, dict(groups)


def measure(shape_name: str, config: str, warmup: int, steps: int, floor: bool) -> dict:
    import bitsandbytes  # noqa: F401  the same imports in every configuration
    import peft  # noqa: F401

    shape = SHAPES[shape_name]
    model = build(shape, config)
    model.train()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    autocast = config == "peft_bnb_bf16"

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))  # fp32 loss
        loss.backward()
        opt.step()
        return loss.item()

    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    profiled_s, groups = profile_groups(step)
    out = {"config": config, "times": times, "loss_first": losses[0], "loss_last": losses[-1],
           "profiled_s": profiled_s, "groups": groups, "threads": torch.get_num_threads(),
           "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if floor:
        calls = record_products(step)
        out["floor_s"], out["floor_by_op"] = time_products(calls)
        out["products"] = sum(calls.values())
        out["product_dtypes"] = sorted({s[3] for (_, args, _), _ in calls.items() for s in args
                                        if isinstance(s, tuple) and s and s[0] == "tensor"})
    return out


# ---- the section (runs in the parent) ------------------------------------------------------------


def _run_config(shape: str, config: str, warmup: int, steps: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--shape", shape, "--config", config,
           "--warmup", str(warmup), "--steps", str(steps)] + (["--floor"] if config == "qlora_bf16" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{shape}/{config} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False, shape: str = "gpt", wait_s: float | None = None) -> Section:
    warmup, steps, rounds = (1, 2, 1) if quick else (2, 4, 2)
    wait_s = (0.0 if quick else WAIT_PER_CONFIG_S) if wait_s is None else wait_s
    spec, support = SHAPES[shape], bf16_support("cpu")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    for r in range(rounds):  # the second round in reverse order, so drift in machine load evens out
        for config in order if r % 2 == 0 else order[::-1]:
            busy, _ = wait_for_quiet(wait_s, log=log)
            log(f"[bench]   bf16 {shape}: {config} (round {r + 1}/{rounds}, machine busy {busy:.0f}%)")
            results[config].append({**_run_config(shape, config, warmup, steps), "busy_before": busy})
    med = {c: statistics.median([t for res in rs for t in res["times"]]) for c, rs in results.items()}
    floor = statistics.median(r["floor_s"] for r in results["qlora_bf16"])
    q = results["qlora_bf16"][0]
    section = Section(
        f"bf16 training step, {shape} shape",
        f"{spec.describe}; LoRA r = {spec.rank}, alpha {spec.alpha:g} on {', '.join(spec.targets)}; AdamW; loss in "
        f"fp32. Ours in bf16: `use_bf16_compute` (frozen base stored in bf16, NF4 dequantized to bf16 into a reused "
        "workspace, LoRA factors fp32 masters computed in bf16, norms, attention softmax and loss in fp32). PEFT + "
        "bitsandbytes in bf16: Linear4bit(compute_dtype=bf16) with the forward under torch.autocast('cpu', bf16). "
        f"Median of {steps} timed steps × {rounds} subprocess(es) after {warmup} warm-up step(s). The floor: every "
        f"matrix product of one QLoRA bf16 step ({q['products']} calls; dtypes {', '.join(q['product_dtypes'])}), "
        "each timed alone with inputs of the same shapes and strides, summed. 'profiled share': self CPU time by "
        f"group in one profiled step (profiler overhead included). CPU bf16 units: {support.reason}.",
        ["configuration", "median step", "per round", "vs ours QLoRA bf16", "matrix products / attention / casts / "
         "other (profiled share)", "loss step 0 → last", "machine busy before (%)"],
    )
    for config, label in CONFIGS.items():
        rs = results[config]
        shares = []
        for group in ("matrix products", "attention kernel (fp32)", "dtype casts and copies", "other"):
            total = statistics.median(sum(r["groups"].values()) for r in rs)
            shares.append(f"{100 * statistics.median(r['groups'].get(group, 0.0) for r in rs) / total:.0f}%")
        section.rows.append([label, fmt_seconds(med[config]), " / ".join(fmt_seconds(statistics.median(r["times"])) for r in rs),
                             fmt_ratio(med[config] / med["qlora_bf16"]), " / ".join(shares),
                             f"{rs[0]['loss_first']:.4f} → {rs[0]['loss_last']:.4f}",
                             " / ".join(f"{r['busy_before']:.0f}" for r in rs)])
    by_op = q["floor_by_op"]
    section.rows.append(["floor: the matrix products of ours QLoRA bf16, each timed alone, summed", fmt_seconds(floor),
                         " / ".join(fmt_seconds(r["floor_s"]) for r in results["qlora_bf16"]),
                         fmt_ratio(floor / med["qlora_bf16"]),
                         ", ".join(f"{k} {fmt_seconds(v)}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])),
                         "", ""])
    groups = {g: statistics.median(r["groups"].get(g, 0.0) for r in results["qlora_bf16"])
              for g in ("attention kernel (fp32)", "dtype casts and copies", "other")}
    rest = med["qlora_bf16"] - floor
    not_here = "" if support.fast else "not measurable here: this CPU has no bf16 units. "
    section.goals += [
        Goal(f"bf16 step ({shape}): ours QLoRA / PEFT + bitsandbytes (autocast)", med["qlora_bf16"] / med["peft_bnb_bf16"],
             VS_PEFT_BNB_GOAL, False,
             f"{not_here}PEFT + bitsandbytes under autocast casts its frozen weights to bf16 on every call (autocast's "
             f"cache keeps only leaf tensors that require grad) and runs LoRA through PEFT's modules; fp32 beside: "
             f"ours QLoRA {fmt_seconds(med['qlora_fp32'])}, PEFT + bitsandbytes {fmt_seconds(med['peft_bnb_fp32'])}",
             measurable=support.fast),
        Goal(f"bf16 step ({shape}): ours QLoRA / its matrix products alone", med["qlora_bf16"] / floor, VS_FLOOR_GOAL,
             False,
             f"{not_here}the rest, {fmt_seconds(rest)} a step, is outside the products: in one profiled step the fused "
             f"attention kernel (fp32, softmax inside) took {fmt_seconds(groups['attention kernel (fp32)'])}, dtype "
             f"casts {fmt_seconds(groups['dtype casts and copies'])}, everything else (GELU, norms, loss, embeddings, "
             f"NF4 dequantization, AdamW, autograd) {fmt_seconds(groups['other'])}",
             measurable=support.fast),
        Goal(f"bf16 step ({shape}): ours QLoRA / ours LoRA", med["qlora_bf16"] / med["lora_bf16"], VS_LORA_GOAL, False,
             f"{not_here}two NF4 dequantizations of every base weight per step, into one reused bf16 workspace",
             measurable=support.fast),
    ]
    section.notes += [
        f"bf16 over fp32, same run: ours LoRA {fmt_ratio(med['lora_fp32'] / med['lora_bf16'])} faster, ours QLoRA "
        f"{fmt_ratio(med['qlora_fp32'] / med['qlora_bf16'])}, PEFT + bitsandbytes "
        f"{fmt_ratio(med['peft_bnb_fp32'] / med['peft_bnb_bf16'])}",
        f"torch threads in each subprocess: {q['threads']}; trainable params in every row: {q['trainable_params']:,}",
    ]
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one bf16-section configuration, as JSON on the last line")
    parser.add_argument("--shape", default="gpt", choices=list(SHAPES))
    parser.add_argument("--config", required=True, choices=list(CONFIGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--floor", action="store_true", help="also record and time the step's matrix products")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shape, args.config, max(1, args.warmup), max(1, args.steps), args.floor)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

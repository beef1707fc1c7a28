"""One training step on a GPT-shaped stack: ours (full FT, LoRA, QLoRA) against PEFT and PEFT + bitsandbytes.

The stack: MiniGPT d_model 512, 8 layers, 8 heads, vocab 4096, block 128; batch 8 × 128 tokens; LoRA
r = 8, alpha 16 on all six block Linears (q/k/v/o_proj, fc1, fc2); AdamW over the trainable parameters.
Every configuration starts from the same weights (seed 0) and trains on the same batch (seed 1).

Each configuration runs in its own subprocess (`python bench_step.py --config NAME --paced`), so its peak
memory is its own; all stay alive and their timed steps alternate (paced.run_paced), so a ratio of two
step times is measured under the same load. Every subprocess imports the same libraries (torch,
transformers, peft, bitsandbytes, minituner) before building anything, so their baselines match. Peak RSS
is the kernel's high-water mark (VmHWM), reset after the warm-up steps and read after the timed ones.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minigpt.model import GPTConfig, MiniGPT  # noqa: E402
from minigpt.train import lm_loss  # noqa: E402
from minituner import native_lora_fp32  # noqa: E402
from paced import run_paced, serve  # noqa: E402
from report import Goal, Section  # noqa: E402
from timing import (MIB, OPTIMIZER_NOTE, adamw, current_rss_mib, fmt_ratio, fmt_seconds,  # noqa: E402
                    fp32_product_libraries, our_fp32_library, peak_rss_mib, reset_peak_rss, wait_for_quiet)

STACK = GPTConfig(vocab_size=4096, block_size=128, n_layer=8, n_head=8, d_model=512)
BATCH = 8
RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]
LR = 1e-4
QLORA_VS_PEFT_BNB_GOAL = 0.85  # our QLoRA step / PEFT + bitsandbytes QLoRA step
QLORA_VS_LORA_GOAL = 1.15  # our QLoRA step / our LoRA fp32 step
WAIT_S = 120.0  # before starting the subprocesses, wait up to this long for other processes to go quiet
PACED_WARM = 1  # untimed steps at the start of each turn: a process's first step after another's ran slower
PACED_TIMEOUT_S = 3600.0  # the whole paced run

# name -> label, in the order of the table (and of the first turn)
CONFIGS = {
    "full": "ours, full fine-tuning",
    "full_other": "informational: ours, full fine-tuning, fp32 products through the library minikernels.fp32_gemm did not choose here (MINIKERNELS_FP32_GEMM)",
    "lora": "ours, LoRA fp32",
    "qlora": "ours, QLoRA (NF4 base, wrap_minigpt_qlora)",
    "qlora_noguard": "ours, QLoRA without finite-output guards",
    "peft_lora": "PEFT LoRA",
    "peft_bnb_qlora": "PEFT + bitsandbytes QLoRA (Linear4bit nf4)",
    "qlora_bf16": "informational: ours, QLoRA, bfloat16 compute (whole model)",
    "peft_bnb_qlora_bf16": "informational: PEFT + bitsandbytes, compute_dtype bfloat16 (base GEMMs)",
}


# ---- building each configuration (runs inside the subprocess) -----------------------------------


def _block_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS]


def _bnb_linear4bit(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(linear.weight.detach().clone(), requires_grad=False, quant_type="nf4",
                                     blocksize=64, compress_statistics=False)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer.to("cpu")  # quantizes the weight


def build(config: str) -> tuple[nn.Module, dict]:
    """The model of one configuration, with only its trainable parameters requiring grad, and facts about it."""
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    torch.manual_seed(0)
    model = MiniGPT(STACK)
    facts: dict = {}
    if config in ("full", "full_other", "lora"):  # ours as every command builds them (heap trims on CPU included)
        build_for_training(model, config.removesuffix("_other"), LoRAConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS), device="cpu",
                           compute_dtype=torch.float32)
    elif config in ("qlora", "qlora_noguard", "qlora_bf16"):
        from minituner.build import wrap_minigpt_qlora

        dtype = torch.bfloat16 if config == "qlora_bf16" else torch.float32
        wrap_minigpt_qlora(model, r=RANK, alpha=ALPHA, targets=TARGETS, device="cpu", compute_dtype=dtype,
                           guards=config != "qlora_noguard")
    elif config == "peft_lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    elif config in ("peft_bnb_qlora", "peft_bnb_qlora_bf16"):
        from peft import LoraConfig, get_peft_model

        from miniquant import quantize_nf4

        same = True
        for path in _block_linears(model):
            parent, _, leaf = path.rpartition(".")
            linear = model.get_submodule(path)
            q4 = _bnb_linear4bit(linear, torch.bfloat16 if config.endswith("bf16") else torch.float32)
            same &= torch.equal(q4.weight.data.reshape(-1), quantize_nf4(linear.weight.detach()).packed)
            setattr(model.get_submodule(parent), leaf, q4)
        facts["nf4_bytes_equal_ours"] = bool(same)
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    else:
        raise ValueError(f"unknown configuration {config!r}; valid: {list(CONFIGS)}")
    facts["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    facts["resident_tensor_mib"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / MIB
    return model, facts


def _dequantize_all_seconds(model: nn.Module, config: str) -> float | None:
    """Median time to dequantize every quantized base weight once (what a step does twice)."""
    if config in ("qlora", "qlora_noguard"):
        from miniquant import QuantizedLinear

        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        fn = lambda: [m.dequantize(torch.float32) for m in layers]  # noqa: E731
    elif config == "peft_bnb_qlora":
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf

        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        fn = lambda: [bf.dequantize_4bit(m.weight.data, m.weight.quant_state) for m in layers]  # noqa: E731
    else:
        return None
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# addmm_ (LoRA's thin update) not counted; mkldnn::_linear_pointwise is minikernels.fp32_gemm's oneDNN product
THIN_IN_C = (" (BLAS's: our adapters' thin products, r wide, run as C here, minituner.native_lora_fp32, and count "
             "outside them)")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")



def _gemm_share(step) -> tuple[float, float]:
    """(seconds in the big matrix products, seconds of the whole step) for one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6
    return gemm, total


def measure(config: str, warmup: int, steps: int, paced: bool = False) -> dict:
    """Build, warm up, then time `steps` optimizer steps (paced: as the parent asks, paced.serve); peak RSS over
    the steps after the warm-up."""
    import bitsandbytes  # noqa: F401  the same imports in every configuration: equal baselines
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import minituner.lora  # noqa: F401
    import minituner.qlora  # noqa: F401

    rss_imports = current_rss_mib()
    model, facts = build(config)
    model.train()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, STACK.vocab_size, (BATCH, STACK.block_size), generator=g)
    y = torch.randint(0, STACK.vocab_size, (BATCH, STACK.block_size), generator=g)
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if config.startswith("peft"):  # transformers' loss: the logits upcast to fp32, then cross-entropy
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        else:  # ours as every command computes it (minigpt.cross_entropy: the same on fp32 logits)
            loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss.item()

    t0 = time.perf_counter()
    losses = [step()]
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        losses.append(step())
    gc.collect()
    rss_before = current_rss_mib()
    peak_reset = reset_peak_rss()
    times = []
    if paced:
        times, _, paced_losses = serve(step)
        losses += paced_losses
    for _ in range(0 if paced else steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mib()
    gemm_s, step_s = _gemm_share(step)
    deq = _dequantize_all_seconds(model, config)
    return {"config": config, "times": times, "first_s": first_s, "loss_first": losses[0], "loss_last": losses[-1],
            "rss_imports_mib": rss_imports, "rss_before_mib": rss_before, "peak_mib": peak,
            "peak_is_since_reset": peak_reset, "dequantize_all_s": deq, "gemm_s": gemm_s, "profiled_step_s": step_s, "threads": torch.get_num_threads(), **facts}


# ---- the section (runs in the parent) ------------------------------------------------------------


def _other_library() -> str:
    """The fp32 product library minikernels.fp32_gemm did not choose on this machine (the informational row's)."""
    from minikernels import fp32_gemm

    return "aten" if fp32_gemm.backend() == "onednn" else "onednn"


def _command(config: str, warmup: int) -> tuple[list[str], dict | None]:
    """A configuration's paced subprocess (command, extra environment)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", config, "--warmup", str(warmup), "--paced"]
    return cmd, {"MINIKERNELS_FP32_GEMM": _other_library()} if config.endswith("_other") else None  # fp32_gemm's override


def run(quick: bool = False) -> Section:
    from minigpt.bf16_support import bf16_support

    warmup, steps = (1, 2) if quick else (2, 8)
    support = bf16_support("cpu")  # without bf16 units the bf16 rows would take many times the rest: left out
    configs = [c for c in CONFIGS if support.fast or not c.endswith("bf16")]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    busy, _ = wait_for_quiet(0.0 if quick else WAIT_S, log=log)
    log(f"[bench]   step: {len(configs)} configurations side by side, {steps} turns (machine busy {busy:.0f}%)")
    load_before = os.getloadavg()
    results = run_paced({c: _command(c, warmup) for c in configs}, turns=steps, warm=PACED_WARM,
                        timeout_s=PACED_TIMEOUT_S)
    failed = {c: r["error"] for c, r in results.items() if "error" in r}
    if failed:
        raise RuntimeError(f"step configurations failed: {failed}")
    load_after = os.getloadavg()
    med = {c: statistics.median(r["times"]) for c, r in results.items()}
    section = Section(
        "Training step, GPT-shaped stack",
        f"MiniGPT d_model {STACK.d_model}, {STACK.n_layer} layers, {STACK.n_head} heads, vocab {STACK.vocab_size}, "
        f"block {STACK.block_size}; batch {BATCH} × {STACK.block_size} tokens; LoRA r = {RANK}, alpha {ALPHA:g} on "
        f"{', '.join(TARGETS)}; float32 compute; {OPTIMIZER_NOTE}. One step = forward, cross-entropy, backward, optimizer "
        f"step. Every configuration in its own subprocess, all alive together: each built and warmed up "
        f"({warmup} step(s)) in turn, then {steps} turns in which each takes {PACED_WARM} untimed step and one "
        "timed step, who goes first rotating and the rest shuffled (paced.run_paced), so load from other "
        f"processes falls on every row alike; 'median step' is the median of its {steps} timed steps, 'fastest' "
        "the fastest; 'first step' "
        "is its first step after building. Peak RSS: the process's high-water mark over the steps after the "
        "warm-up; 'over imports' subtracts the RSS right after importing the libraries, before the model was built "
        "(model, optimizer state, activations, temporaries and allocator caches). "
        f"'matrix products': self time of {', '.join(GEMM_OPS)} in one profiled step after the timed ones. Ours are "
        "built as every command builds them (build_for_training: on CPU glibc keeps what a step frees, "
        "minituner.memory.heap.keep_freed_memory); PEFT's subprocesses run with glibc's defaults, as transformers "
        f"does. The whole machine's CPU use before the subprocesses started: {busy:.0f}%; load average "
        f"{load_before[0]:.1f} then, {load_after[0]:.1f} at the end (1 min).",
        ["configuration", "median step", "fastest step", "first step", "vs our LoRA", "trainable params",
         "peak RSS (MiB)", "peak over imports (MiB)", "matrix products (% of step)", "loss step 0 → last"],
    )
    for config, res in results.items():
        section.rows.append([CONFIGS[config], fmt_seconds(med[config]), fmt_seconds(min(res["times"])),
                             fmt_seconds(res["first_s"]), fmt_ratio(med[config] / med["lora"]),
                             f"{res['trainable_params']:,}", f"{res['peak_mib']:.0f}",
                             f"{res['peak_mib'] - res['rss_imports_mib']:.0f}",
                             f"{100 * res['gemm_s'] / res['profiled_step_s']:.0f}",
                             f"{res['loss_first']:.4f} → {res['loss_last']:.4f}"])
    ours_deq = results["qlora"]["dequantize_all_s"]
    bnb_deq = results["peft_bnb_qlora"]["dequantize_all_s"]
    share = {c: r["gemm_s"] / r["profiled_step_s"] for c, r in results.items()}
    rest = {c: med[c] * (1 - share[c]) for c in results}
    budget = QLORA_VS_PEFT_BNB_GOAL * med["peft_bnb_qlora"] - med["qlora"] * share["qlora"]
    section.goals.append(Goal(
        "QLoRA step: ours / PEFT + bitsandbytes", med["qlora"] / med["peft_bnb_qlora"], QLORA_VS_PEFT_BNB_GOAL, False,
        f"both run float32 products of the same shapes on dequantized weights, {fp32_product_libraries()}. Matrix "
        f"products{THIN_IN_C if native_lora_fp32.kernels() is not None else ''} take {share['qlora']:.0%} of "
        f"our step and {share['peft_bnb_qlora']:.0%} of theirs (one profiled step each). The goal allows "
        f"{fmt_seconds(budget)} for everything else in ours; it spends {fmt_seconds(rest['qlora'])} (PEFT + "
        f"bitsandbytes: {fmt_seconds(rest['peft_bnb_qlora'])}), much of it the model's own attention, norms, GELU, "
        "loss and AdamW, common to every row. Differences outside the products: the LoRA path (PEFT LoRA / our "
        f"LoRA, both fp32: {med['peft_lora'] / med['lora']:.2f}×) and dequantizing all {len(TARGETS) * STACK.n_layer} "
        f"base weights, twice per step: {fmt_seconds(ours_deq)} (ours) vs {fmt_seconds(bnb_deq)} (bitsandbytes) a pass",
    ))
    section.goals.append(Goal(
        "QLoRA step: ours / our LoRA fp32", med["qlora"] / med["lora"], QLORA_VS_LORA_GOAL, False,
        f"two dequantizations of every base weight per step ({fmt_seconds(2 * ours_deq)}) and the custom "
        f"Function around each; wrap_minigpt_qlora's finite-output guards: {fmt_seconds(med['qlora'])} with, "
        f"{fmt_seconds(med['qlora_noguard'])} without",
    ))
    same = results["peft_bnb_qlora"].get("nf4_bytes_equal_ours")
    other_library = "oneDNN" if _other_library() == "onednn" else "PyTorch's F.linear"
    section.notes += [
        f"full fine-tuning with its fp32 products and input gradients through {our_fp32_library()} "
        f"(minikernels.fp32_gemm's choice for this CPU) / through "
        f"{other_library} (the weights' gradients "
        f"by torch.mm in both): {med['full'] / med['full_other']:.2f}× the step time",
        f"bitsandbytes Linear4bit is built with compress_statistics=False (no double quantization), like ours; its "
        f"packed NF4 bytes equal ours for every layer: {'yes' if same else 'no'}",
        "our QLoRA keeps nothing dequantized for backward (it dequantizes again there) and computes no gradient for "
        "the frozen base; both QLoRA rows hold the weights in NF4 (4.5 bits per value with float32 absmax per 64)",
        f"peak RSS is the kernel's VmHWM reset after warm-up ({'yes' if res['peak_is_since_reset'] else 'no: since process start'}); "
        "freed memory the allocator keeps counts as resident",
        f"torch threads in each subprocess: {res['threads']}",
    ]
    if not support.fast:
        section.notes.append(f"the informational bf16 rows did not run: {support.reason}, where bf16 products run "
                             "many times slower than fp32 (the bf16 sections time them)")
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one training-step configuration, as JSON on the last line")
    parser.add_argument("--config", required=True, choices=list(CONFIGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps, alone (without --paced)")
    parser.add_argument("--paced", action="store_true", help="timed steps on 'step' lines from stdin (paced.serve)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.config, max(1, args.warmup), max(1, args.steps), args.paced)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

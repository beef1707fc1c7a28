"""Lab 03: QLoRA preview: MiniGPT's Linears in NF4, Lab 02's LoRA adapter on top, checked, trained, measured.

    python experiments/28-qlora-preview/lab03.py [--base artifacts/base]

needs a pretrained base (`make demo` makes one) and Lab 02's adapter (committed); runs in about a minute
on 2 CPU cores and writes beside this file: results.json (every figure), REPORT.md (REPORT.template.md filled
from it), manifest.json, adapter_final.safetensors (the QLoRA-trained adapter), adapter_peft/, metrics.jsonl and
loss_curve.png. Blocks: A build and show, B NF4 vs fp logits, C one epoch of QLoRA, D memory, E adapter swap.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from minigpt.base_folder import MANIFEST, WEIGHTS
from minigpt.data import eval_batches
from minigpt.errors import InputError
from minigpt.io import atomic_write_text, sha256_file, write_json
from minigpt.manifest import write_manifest
from minigpt.train import TrainConfig, evaluate
from miniquant import DEFAULT_QUANT_SCHEME
from minituner.adapter_io import ADAPTER_FILE, load_adapter, read_adapter
from minituner.base_model import load_base
from minituner.build import build_for_training
from minituner.finetune import DEFAULT_DATA, PEFT_DIR, FinetuneConfig, encode_domain, finetune
from minituner.lora import LoRAConfig, load_lora_state_dict
from minituner.memory.fresh_run import lora_vs_qlora
from minituner.planner import MemoryConfig
from minituner.qlora_checks import adapter_swap, logit_check, wrapped_layer
from minituner.qlora_report import manifest_fields, report_values, summary_line
from minituner.run_info import display_path, precision_run, run_summary

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAB02_ADAPTER = ROOT / "experiments" / "28-lora-finetune" / ADAPTER_FILE
LORA = LoRAConfig(r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")  # Lab 02's adapter
SCHEME = DEFAULT_QUANT_SCHEME
COMPARE_SCHEMES = ("int8_per_group_64", "int4_per_group_64", SCHEME)  # Phase 26's int schemes beside NF4
TRAIN = TrainConfig(steps=1, batch_size=32, lr=1e-3, warmup_steps=10, schedule="cosine", eval_every=50, seed=1337)
EPOCHS = 1.0  # TRAIN.steps is replaced by one pass over the forecasts train split
PROMPTS = 16  # block B: the first 16 validation windows of forecasts, block_size characters each
TOLERANCE = 0.03  # block B: mean |logit diff| / mean |logits|; the seed expects roughly 1-3%
MEMORY = MemoryConfig()  # block D: the planner's batch 16 x 32 tokens, fp16 float storage
MEMORY_STEPS = 2
MEMORY_ROWS = {"lora-fp16": "LoRA, fp16 base", "qlora-nf4": "QLoRA, NF4 base (fp16 rest)"}


def qlora_model(base: Path, scheme: str = SCHEME, adapter_name: str = "default") -> torch.nn.Module:
    return build_for_training(load_base(base)[0], "qlora", LORA, scheme, "cpu", adapter_name=adapter_name)


def with_adapter(base: Path) -> torch.nn.Module:
    model, _ = load_base(base)
    load_adapter(model, LAB02_ADAPTER)
    return model


def block_b(base: Path, x: torch.Tensor, val_ids: torch.Tensor) -> dict:
    """Lab 02's adapter on the fp base and on quantized bases: logits on a fixed batch, weight error, val loss."""
    plain = load_base(base)[0]
    val = lambda m: evaluate(m, val_ids, plain.config.block_size, TRAIN.batch_size, TRAIN.eval_batches)  # noqa: E731
    return logit_check(plain, lambda: with_adapter(base), lambda s: qlora_model(base, s),
                       read_adapter(LAB02_ADAPTER)[0], COMPARE_SCHEMES, x, val, TOLERANCE)


def block_c(base: Path, tmp: Path, progress: bool) -> dict:
    """One epoch of QLoRA from Lab 02's adapter, with minituner finetune (a NaN/Inf loss stops it at any step),
    in fp32 (the run kept beside this file) and again in bf16."""
    cfg = FinetuneConfig(data=DEFAULT_DATA, lora=LORA, train=TRAIN, epochs=EPOCHS, init_adapter=str(LAB02_ADAPTER),
                         base_domain=None, quant_scheme=SCHEME)
    res = finetune(base, tmp, cfg, progress=progress)
    for name in (ADAPTER_FILE, "metrics.jsonl", "loss_curve.png"):
        shutil.copyfile(tmp / name, HERE / name)
    shutil.rmtree(HERE / PEFT_DIR, ignore_errors=True)
    shutil.copytree(tmp / PEFT_DIR, HERE / PEFT_DIR)
    bf16 = precision_run(base, cfg, "bf16", tmp.parent / "bf16", progress)  # the same epoch, frozen base in bf16
    return {**run_summary(tmp, res.summary), "bf16": bf16, "batch_size": TRAIN.batch_size, "lr": TRAIN.lr,
            "warmup_steps": TRAIN.warmup_steps, "schedule": TRAIN.schedule, "seed": TRAIN.seed}


def block_d(base: Path) -> dict:
    """LoRA on an fp16 base vs QLoRA on an NF4 base, each measured in a fresh process; the planner beside them."""
    return lora_vs_qlora(base, LAB02_ADAPTER, LORA, DEFAULT_DATA, MEMORY, MEMORY_STEPS, TRAIN, list(MEMORY_ROWS))


def block_e(base: Path, x: torch.Tensor, val_ids: torch.Tensor) -> dict:
    """Lab 02's adapter and the QLoRA-trained one on the same NF4 base, switched with set_adapter."""
    model = qlora_model(base, adapter_name="lab02")
    load_lora_state_dict(model, read_adapter(LAB02_ADAPTER)[0], adapter_name="lab02")
    load_adapter(model, HERE / ADAPTER_FILE, adapter_name="qlora")
    block = model.config.block_size
    return adapter_swap(model, ("lab02", "qlora"), x,
                        lambda m: evaluate(m, val_ids, block, TRAIN.batch_size, TRAIN.eval_batches))


def run(base: Path, progress: bool) -> dict:
    start = time.perf_counter()
    model, tok = load_base(base)
    _, val_ids = encode_domain(DEFAULT_DATA, tok, model.config.block_size)
    x, _ = next(eval_batches(val_ids, PROMPTS, model.config.block_size, 1))  # (16, 128): fixed prompts
    results = {"base": display_path(base, ROOT), "base_sha256": sha256_file(base / WEIGHTS),
               "lab02_adapter": display_path(LAB02_ADAPTER, ROOT), "lab02_adapter_sha256": sha256_file(LAB02_ADAPTER),
               "model": model.config.to_dict(), "lora": LORA.to_dict(), "scheme": SCHEME, "device": "cpu",
               "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg()[0]}
    results["A"] = wrapped_layer(qlora_model(base), "blocks.0.attn.q_proj", LORA)
    print(results["A"]["summary_text"])
    results["B"] = block_b(base, x, val_ids)
    print(f"B: mean |logit diff| / mean |logits| = {results['B']['ratio']:.2%} (tolerance {TOLERANCE:.0%})")
    with tempfile.TemporaryDirectory() as tmp:
        results["C"] = block_c(base, Path(tmp) / "run", progress)
    results["D"], results["E"] = block_d(base), block_e(base, x, val_ids)
    results["wall_time_s"] = time.perf_counter() - start
    results["load_average_end"] = os.getloadavg()[0]
    return results


def render(r: dict) -> str:
    """REPORT.md from results.json: every number below is one the script measured or the planner computed."""
    return (HERE / "REPORT.template.md").read_text(encoding="utf-8").format_map(report_values(r, MEMORY_ROWS))


def write_lab_manifest(base: Path, r: dict) -> None:
    settings = {"lora": LORA.to_dict(), "quant_scheme": SCHEME, "epochs": EPOCHS, "tolerance": TOLERANCE}
    config, extra = manifest_fields(r, settings)
    write_manifest(HERE / MANIFEST, seed=TRAIN.seed, config=config, wall_time_s=r["wall_time_s"],
                   base_weights=base / WEIGHTS, adapter=HERE / ADAPTER_FILE, extra=extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, default=ROOT / "artifacts" / "base")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render-only", action="store_true", help="rewrite REPORT.md from results.json without running")
    args = p.parse_args(argv)
    try:
        if args.render_only:
            results = json.loads((HERE / "results.json").read_text(encoding="utf-8"))
        else:
            if not (args.base / WEIGHTS).is_file():
                raise InputError(f"{args.base}: no base model; run `make demo` or `minituner pretrain --out {args.base}`")
            if not LAB02_ADAPTER.is_file():
                raise InputError(f"{LAB02_ADAPTER}: Lab 02's adapter is missing; run experiments/28-lora-finetune/lab02.py")
            results = run(args.base, progress=not args.no_progress)
            write_json(HERE / "results.json", results)
            write_lab_manifest(args.base, results)
    except InputError as e:
        print(f"lab03: error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(HERE / "REPORT.md", render(results))
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

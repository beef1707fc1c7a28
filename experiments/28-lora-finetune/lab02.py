"""Lab 02: LoRA r=8 on every Linear of the pretrained MiniGPT, fine-tuned on weather forecasts.

    python experiments/28-lora-finetune/lab02.py [--base artifacts/base]

needs a base from `minituner pretrain` (`make demo` makes one), trains for a few minutes on 2 CPU cores
(fp32, then the same run in bf16 for comparison) and writes beside this file: adapter_final.safetensors,
adapter_peft/, metrics.jsonl, loss_curve.png, manifest.json (the fp32 run), results.json (every figure)
and REPORT.md (REPORT.template.md filled from results.json).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from minigpt.base_folder import WEIGHTS
from minigpt.errors import InputError
from minigpt.io import atomic_write_text, sha256_file, write_json
from minigpt.train import TrainConfig, evaluate
from minituner.adapter_io import ADAPTER_FILE, load_adapter
from minituner.base_model import load_base
from minituner.finetune import BASE_DOMAIN, DEFAULT_DATA, PEFT_DIR, FinetuneConfig, encode_domain, finetune
from minituner.lora import LoRAConfig, merge_lora
from minituner.parity import peft_max_logit_diff
from minituner.run_info import base_pretrain, display_path, precision_run, run_speed, sample_texts
from minituner.zoo import adapters_disabled, set_adapter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LORA = LoRAConfig(r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")
TRAIN = TrainConfig(steps=300, batch_size=32, lr=5e-3, warmup_steps=20, schedule="cosine", eval_every=50, seed=1337)
PROMPTS = ("Bergen, ", "The ")
WEIGHTS_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
KiB = 1024
BF16_GOAL = 0.01  # the bf16 run's final val loss within 1% (relative) of fp32's (issue 13)
TEMPLATE = HERE / "REPORT.template.md"


def run(base: Path, progress: bool) -> dict:
    cfg = FinetuneConfig(data=DEFAULT_DATA, lora=LORA, train=TRAIN, base_domain=BASE_DOMAIN)
    model, tokenizer = load_base(base)  # samples before: the base alone
    before = sample_texts(model, tokenizer, PROMPTS)
    res = finetune(base, HERE, cfg, progress=progress, overwrite=True)  # the lab rewrites its own run
    model, s = res.model.eval(), res.summary
    block, ev = model.config.block_size, (TRAIN.batch_size, TRAIN.eval_batches)
    _, new_val = encode_domain(DEFAULT_DATA, tokenizer, block)
    _, old_val = encode_domain(BASE_DOMAIN, tokenizer, block)
    with adapters_disabled(model):  # the frozen base is still there, bit for bit
        disabled = {"new": evaluate(model, new_val, block, *ev), "old": evaluate(model, old_val, block, *ev)}
    sweep = []
    for w in WEIGHTS_SWEEP:  # the adapter scaled by w: from the base (0) to the trained adapter (1)
        set_adapter(model, {"default": w})
        sweep.append({"weight": w, "new": evaluate(model, new_val, block, *ev), "old": evaluate(model, old_val, block, *ev)})
    set_adapter(model, "default")
    after = sample_texts(model, tokenizer, PROMPTS)
    reloaded, _ = load_base(base)  # a fresh base + the adapter file, as Lab 03 will load it
    load_adapter(reloaded, HERE / ADAPTER_FILE)
    reloaded_val = evaluate(reloaded, new_val, block, *ev)
    peft_diff = peft_max_logit_diff(load_base(base)[0], HERE / PEFT_DIR, reloaded,
                                    new_val[:block].unsqueeze(0))  # (1, T): one validation window
    merge_lora(reloaded)
    with tempfile.TemporaryDirectory() as tmp:  # the same fine-tune with the frozen base in bf16
        bf16 = precision_run(base, cfg, "bf16", Path(tmp) / "bf16", progress)
    return {
        "base": display_path(base, ROOT),
        "base_sha256": sha256_file(base / WEIGHTS),
        "base_pretrain": base_pretrain(base),
        "model": model.config.to_dict(),
        "block_size": block,
        "lora": LORA.to_dict(),
        "train": {k: getattr(TRAIN, k) for k in ("steps", "batch_size", "lr", "warmup_steps", "schedule", "seed")},
        "summary": s,
        "disabled_val_loss": disabled,
        "merged_val_loss": evaluate(reloaded, new_val, block, *ev),
        "reloaded_val_loss": reloaded_val,
        "peft_max_logit_diff": peft_diff,
        "sweep": sweep,
        "peft_bytes": (HERE / PEFT_DIR / "adapter_model.safetensors").stat().st_size,
        "samples_before": before,
        "samples_after": after,
        "fp32_speed": run_speed(HERE),
        "bf16": bf16,
    }


def render(r: dict) -> str:
    """REPORT.md from results.json: every number below is one the script measured."""
    s, lora, t, d, bp = r["summary"], r["lora"], r["train"], r["model"]["d_model"], r["base_pretrain"]
    new, old = s["val_loss_before"], s["val_loss_after"]
    fence = "```"
    pairs = "\n\n".join(f"**prompt {p!r}**\n\nbase alone:\n\n{fence}text\n{b}\n{fence}\n\nbase + adapter:\n\n{fence}text\n{a}\n{fence}"
                        for p, b, a in zip(PROMPTS, r["samples_before"], r["samples_after"]))
    values = dict(
        r=r, s=s, lora=lora, t=t, d=d, new=new, old=old, data=DEFAULT_DATA, sha16=r["base_sha256"][:16],
        pre=("no manifest.json, pretraining unknown" if bp is None else
             f"`minituner pretrain`, {bp['steps']} steps on `{bp['data']}`, val loss {bp['val_loss']:.3f} nats/token there"),
        scaling=lora["alpha"] / lora["r"], gain=new - old, gain_frac=(new - old) / new, ppl_new=math.exp(new),
        ppl_old=math.exp(old), forget=s["base_domain_val_loss_after"] - s["base_domain_val_loss_before"],
        base_kib=s["base_bytes"] / KiB, artifact_kib=s["artifact_bytes"] / KiB, peft_kib=r["peft_bytes"] / KiB,
        artifact_frac=s["artifact_bytes"] / s["base_bytes"], peft_frac=r["peft_bytes"] / s["base_bytes"],
        square_frac=2 * lora["r"] / d, big_frac=2 * lora["r"] / 4096,
        sweep="\n".join(f"| {row['weight']:.2f} | {row['new']:.3f} | {row['old']:.3f} |" for row in r["sweep"]),
        peft=("not measured (peft is not installed; `make test` installs it)" if r["peft_max_logit_diff"] is None
              else f"max |logit difference| {r['peft_max_logit_diff']:.2e}"),
        pairs=pairs, **bf16_values(r),
    )
    return TEMPLATE.read_text(encoding="utf-8").format_map(values)


def bf16_values(r: dict) -> dict:
    """The bf16 section's figures: bf16's final val loss against fp32's, and each run's speed."""
    b, fp32, fp32_speed = r["bf16"], r["summary"]["val_loss_after"], r["fp32_speed"]
    rel = (b["val_loss_after"] - fp32) / fp32
    speedup, m = b["tokens_per_s"] / fp32_speed["tokens_per_s"], r["model"]
    why = ("bf16 pays off for large matrix products; this model's are small (d_model "
           f"{m['d_model']}), and its {m['d_model'] // m['n_head']}-wide attention heads are where PyTorch's fused "
           "CPU attention kernel is slowest in bf16." if speedup < 1 else
           f"bf16's matrix products outweigh its casts even at d_model {m['d_model']}.")
    return dict(b=b, fps=fp32_speed, bf16_rel=rel, bf16_met="met" if abs(rel) <= BF16_GOAL else "**not met**",
                bf16_goal=BF16_GOAL, bf16_speedup=speedup, bf16_why=why, bf16_units=b["bf16_support"]["reason"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, default=ROOT / "artifacts" / "base")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render-only", action="store_true", help="rewrite REPORT.md from results.json without training")
    args = p.parse_args(argv)
    try:
        if args.render_only:
            results = json.loads((HERE / "results.json").read_text(encoding="utf-8"))
        else:
            if not (args.base / WEIGHTS).is_file():
                raise InputError(f"{args.base}: no base model; run `make demo` or `minituner pretrain --out {args.base}`")
            results = run(args.base, progress=not args.no_progress)
            write_json(HERE / "results.json", results)
    except InputError as e:
        print(f"lab02: error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(HERE / "REPORT.md", render(results))
    s = results["summary"]
    print(f"forecasts val loss {s['val_loss_before']:.3f} -> {s['val_loss_after']:.3f}; python-docs "
          f"{s['base_domain_val_loss_before']:.3f} -> {s['base_domain_val_loss_after']:.3f}; "
          f"trainable {s['trainable_fraction']:.2%}; adapter {s['artifact_bytes']:,} B vs base {s['base_bytes']:,} B")
    v = bf16_values(results)
    print(f"bf16: forecasts val loss {v['b']['val_loss_after']:.4f} vs fp32 {s['val_loss_after']:.4f} "
          f"({v['bf16_rel']:+.2%}; goal within {BF16_GOAL:.0%}: {v['bf16_met']})")
    print(f"wrote {HERE / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Lab 02: LoRA r=8 on every Linear of the pretrained MiniGPT, fine-tuned on weather forecasts.

    python experiments/28-lora-finetune/lab02.py [--base artifacts/base]

needs a base from `minituner pretrain` (`make demo` makes one), trains for about a minute or two on
2 CPU cores and writes beside this file: adapter_final.safetensors, adapter_peft/, metrics.jsonl,
loss_curve.png, manifest.json, results.json (every figure) and REPORT.md (rendered from results.json).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from minigpt.base_folder import MANIFEST, WEIGHTS
from minituner.base_model import load_base
from minigpt.errors import InputError
from minigpt.io import atomic_write_text, read_json, sha256_file, write_json
from minigpt.train import TrainConfig, evaluate
from minituner.adapter_io import ADAPTER_FILE, load_adapter
from minituner.finetune import BASE_DOMAIN, DEFAULT_DATA, PEFT_DIR, FinetuneConfig, encode_domain, finetune
from minituner.lora import LoRAConfig, merge_lora
from minituner.zoo import adapters_disabled, set_adapter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LORA = LoRAConfig(r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")
TRAIN = TrainConfig(steps=300, batch_size=32, lr=5e-3, warmup_steps=20, schedule="cosine", eval_every=50, seed=1337)
PROMPTS = ("Bergen, ", "The ")
WEIGHTS_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
KiB = 1024


def display_path(path: Path) -> str:
    """A path relative to the repository when it lies inside it (so the report reads the same everywhere)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def base_pretrain(base: Path) -> dict | None:
    """How the base was pretrained, from its manifest.json (None if it has none)."""
    if not (base / MANIFEST).is_file():
        return None
    m = read_json(base / MANIFEST)
    return {"steps": m["config"]["train"]["steps"], "data": m["config"]["data"],
            "val_loss": m.get("results", {}).get("final_val_loss")}


def samples(model, tokenizer, n_tokens: int = 120, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([tokenizer.encode(p)]), n_tokens, temperature=0.8, generator=gen)
        out.append(tokenizer.decode(ids[0].tolist()))
    return out


def peft_max_diff(base: Path, model, x: torch.Tensor) -> float | None:
    """max |logit difference| between PEFT loading adapter_peft/ and our model; None without peft."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    fresh, _ = load_base(base)
    theirs = PeftModel.from_pretrained(fresh, HERE / PEFT_DIR).eval()
    with torch.no_grad():
        return float((theirs(x) - model(x)).abs().max())


def run(base: Path, progress: bool) -> dict:
    cfg = FinetuneConfig(data=DEFAULT_DATA, lora=LORA, train=TRAIN, base_domain=BASE_DOMAIN)
    model, tokenizer = load_base(base)  # samples before: the base alone
    before = samples(model, tokenizer)
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
    after = samples(model, tokenizer)
    reloaded, _ = load_base(base)  # a fresh base + the adapter file, as Lab 03 will load it
    load_adapter(reloaded, HERE / ADAPTER_FILE)
    reloaded_val = evaluate(reloaded, new_val, block, *ev)
    peft_diff = peft_max_diff(base, reloaded, new_val[:block].unsqueeze(0))  # (1, T): one validation window
    merge_lora(reloaded)
    return {
        "base": display_path(base),
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
    }


def render(r: dict) -> str:
    """REPORT.md from results.json: every number below is one the script measured."""
    s = r["summary"]
    new, old = s["val_loss_before"], s["val_loss_after"]
    gain = new - old
    forget = s["base_domain_val_loss_after"] - s["base_domain_val_loss_before"]
    peft = ("not measured (peft is not installed; `make test` installs it)" if r["peft_max_logit_diff"] is None
            else f"max |logit difference| {r['peft_max_logit_diff']:.2e}")
    sweep = "\n".join(f"| {row['weight']:.2f} | {row['new']:.3f} | {row['old']:.3f} |" for row in r["sweep"])
    fence = "```"
    pairs = "\n\n".join(f"**prompt {p!r}**\n\nbase alone:\n\n{fence}text\n{b}\n{fence}\n\nbase + adapter:\n\n{fence}text\n{a}\n{fence}"
                        for p, b, a in zip(PROMPTS, r["samples_before"], r["samples_after"]))
    lora, t, d = r["lora"], r["train"], r["model"]["d_model"]
    bp = r["base_pretrain"]
    pre = ("no manifest.json, pretraining unknown" if bp is None else
           f"`minituner pretrain`, {bp['steps']} steps on `{bp['data']}`, val loss {bp['val_loss']:.3f} nats/token there")
    return f"""# Lab 02: LoRA fine-tuning of MiniGPT on a new domain

`python experiments/28-lora-finetune/lab02.py --base {r['base']}` (`make demo` runs it on `artifacts/base`)
trains a LoRA adapter on the pretrained MiniGPT and writes this report from `results.json`; every number
here is printed by that script.

- **Base:** `{r['base']}`: {pre}; weights sha256 `{r['base_sha256'][:16]}...`; d_model {d},
  {r['model']['n_layer']} layers.
- **Adapter:** r = {lora['r']}, alpha = {lora['alpha']:g} (scaling alpha/r = {lora['alpha'] / lora['r']:g}), dropout {lora['dropout']:g},
  targets `{lora['target_modules']}` = `q_proj`, `k_proj`, `v_proj`, `o_proj`, `fc1`, `fc2` of every block
  (never the tied `lm_head`); A kaiming-uniform, B = 0, so step 0 is the base.
- **Training:** `{DEFAULT_DATA}` (seeded weather bulletins the base never saw), {t['steps']} AdamW steps of
  {t['batch_size']} x {r['block_size']}-token windows, peak LR {t['lr']:g}, {t['warmup_steps']} warmup steps then {t['schedule']}, seed {t['seed']};
  {s['train_wall_time_s']:.0f} s of training.
- **Loss:** next-character cross-entropy in nats/token on each corpus's validation split
  ({s['val_tokens']:,} tokens for forecasts), 16 fixed batches of {t['batch_size']} windows.

![training and validation loss](loss_curve.png)

## Results

| measure | base | base + adapter |
|---|---|---|
| val loss on forecasts (new domain), nats/token | {new:.3f} | {old:.3f} |
| val loss on python-docs (base domain), nats/token | {s['base_domain_val_loss_before']:.3f} | {s['base_domain_val_loss_after']:.3f} |

- **New domain:** the adapter lowers forecast loss by {gain:.3f} nats/token ({gain / new:.0%}), i.e. perplexity
  {math.exp(new):.1f} -> {math.exp(old):.2f}.
- **Forgetting:** with the adapter on, python-docs loss rises by {forget:+.3f} nats/token: every Linear now
  serves forecasts. The base weights are frozen, so nothing is lost for good: with the adapter disabled
  (`adapters_disabled`) python-docs loss is {r['disabled_val_loss']['old']:.3f} and forecast loss {r['disabled_val_loss']['new']:.3f},
  the base's own numbers, and one switch chooses between the two models.

| | parameters | share of base |
|---|---|---|
| base MiniGPT (all, tied `lm_head` once) | {s['params_total']:,} | 100% |
| trainable LoRA A and B (r x in + out x r per Linear) | {s['params_trainable']:,} | {s['trainable_fraction']:.2%} |

| file | bytes | KiB (1024 B) | vs base file |
|---|---|---|---|
| base `model.safetensors` (fp32) | {s['base_bytes']:,} | {s['base_bytes'] / KiB:,.1f} | 100% |
| `adapter_final.safetensors` (fp32) | {s['artifact_bytes']:,} | {s['artifact_bytes'] / KiB:,.1f} | {s['artifact_bytes'] / s['base_bytes']:.1%} |
| `adapter_peft/adapter_model.safetensors` | {r['peft_bytes']:,} | {r['peft_bytes'] / KiB:,.1f} | {r['peft_bytes'] / s['base_bytes']:.1%} |

The trainable share is large because MiniGPT is tiny: LoRA adds r(in + out) parameters per Linear against
in x out, {2 * lora['r'] / d:.2%} of a square {d} x {d} projection at r = {lora['r']}; the same r on a 4096 x 4096
projection adds {2 * lora['r'] / 4096:.2%}.

## Scaling the adapter

The adapter's output weight (`set_adapter(model, {{"default": w}})`) moves the model between the base (w = 0)
and the fine-tuned model (w = 1):

| adapter weight w | forecasts val loss | python-docs val loss |
|---|---|---|
{sweep}

## Checks

- Adapter reloaded from `adapter_final.safetensors` into a fresh base: forecast loss {r['reloaded_val_loss']:.6f}
  (trained model {old:.6f}).
- Adapter merged into the weights (`merge_lora`, fp32): forecast loss {r['merged_val_loss']:.6f}.
- PEFT (`PeftModel.from_pretrained(<a MiniGPT>, "adapter_peft")`) on one validation window: {peft}.
- `manifest.json` records the sha256 of the base weights and of the adapter, the versions and the config;
  `metrics.jsonl` has every step, `loss_curve.png` plots it.

## Samples (temperature 0.8, seed 0, 120 new characters)

{pairs}
"""


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
    print(f"wrote {HERE / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Lab 01: trainable/frozen parameters and the four-bucket memory of MiniGPT under five regimes.

    python experiments/28-lora-counts/count.py

prints the table for MiniGPT and rewrites REPORT.md and memory_breakdown.png beside this file. Every
number comes from minituner.planner (pure arithmetic); the output is the same on every run, before
or after `minituner pretrain` (see "The model" in REPORT.md).
"""
from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from minigpt.io import atomic_write_text
from minigpt.tokenizer import read_vocab_size
from minituner.planner import (MemoryConfig, Regime, block_linear_weights, builtin_vocab_size, default_regimes,
                               korthikanti_activation_bytes, lora_params, lora_trainable_params, param_counts, plan,
                               preset_shape, quantized_params, regime_bytes, seed_activation_bytes, simplified_shape)
from minituner.planner.memory import NF4_BLOCK, nf4_bytes
from minituner.planner.plot import plot_memory_breakdown
from minituner.planner.presets import PRETRAIN_DATA
from minituner.planner.report import kinds_table, percent, regime_table
from minituner.planner.shapes import ATTENTION

CFG = MemoryConfig()  # the seed's batch 16 x 32 tokens
B, T = CFG.batch_size, CFG.seq_len
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MiB, GiB = 1024**2, 1024**3


def mib(n: int) -> str:
    return f"{n / MiB:,.3f} MiB"


def gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def human(n: int) -> str:
    """MiB below 1 GiB, GiB above."""
    return mib(n) if n < GiB else gib(n)


def minigpt_section(vocab: int) -> tuple[str, object]:
    shape = preset_shape("minigpt", vocab)
    result = plan(shape)  # the seed's five regimes, LoRA on all six Linears of every block
    n = result.total_params
    r8 = next(r for r in result.regimes if r.regime == Regime("lora", 8))
    linear_weights = shape.n_layer * block_linear_weights(shape)
    seed_act, k_act = seed_activation_bytes(shape, B, T), korthikanti_activation_bytes(shape, B, T)
    text = f"""## The model

MiniGPT as `minituner pretrain` builds it: d_model {shape.d_model}, n_layer {shape.n_layer}, n_head {shape.n_head},
d_ff {shape.d_ff}, block_size {shape.n_positions} learned positions, biases in every Linear and LayerNorm,
`lm_head` tied to the token embedding (counted once). vocab_size {vocab} is the size of the character
vocabulary in `artifacts/base/tokenizer.json`, which pretraining builds from the train split of
`{PRETRAIN_DATA}` (CPython's own reference docs). `count.py` reads that file when it exists and
otherwise rebuilds the vocabulary exactly as pretraining does; both give {vocab}, so this report is the
same before and after pretraining. No model is instantiated: the counts are arithmetic on the shape,
and the tests check them against `sum(p.numel() for p in MiniGPT(cfg).parameters())`.

{kinds_table(shape)}

## Trainable and frozen parameters, memory per regime

LoRA targets: all six Linears of every block (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `fc1`, `fc2`),
the seed's choice; biases stay frozen and are not LoRA-ed (PEFT's `bias="none"`). "ratio vs full FT"
is trainable parameters over those of full fine-tuning; "memory vs full FT" compares totals.
Batch {B}, sequence {T}; MiB = 1024² bytes.

{regime_table(result)}

What each bucket holds (bytes per base parameter N and per LoRA parameter P):

- **full FT** (mixed precision): fp16 weights 2N, fp16 grads 2N, optimizer 12N = fp32 master copy 4N +
  Adam m 4N + Adam v 4N: the 16 bytes/param of ZeRO [4]. Plain fp32 full FT (`--full-precision fp32`)
  is 4N + 4N + 8N, also 16 bytes/param, split differently.
- **LoRA r**: frozen fp16 base 2N; A and B in fp16 2P, their fp16 grads 2P, fp32 Adam m and v 8P. Frozen
  weights have no grads and no optimizer state.
- **QLoRA r**: the targeted Linears (here all six of every block) in NF4, 0.5 byte/param + an fp32 absmax per block of
  {NF4_BLOCK} weights (0.0625 byte/param); embeddings, norms and biases in fp16; LoRA as above.
- **activations**: the seed's estimate batch × seq × d_model × n_layer × 16 bytes, the same in every
  regime ({B} × {T} × {shape.d_model} × {shape.n_layer} × 16 = {seed_act:,} bytes). Beside it, Korthikanti et al. [3] count
  s·b·h·(34 + 5·a·s/h) bytes per layer for a GPT block (16-bit activations, no recomputation, no
  tensor or sequence parallelism, 1-byte dropout masks, the a·s² attention scores stored as without
  FlashAttention, embeddings and logits left out): {k_act:,} bytes = {mib(k_act)} here. The table follows the seed;
  `minituner count --activations korthikanti` uses the formula instead.

## What fraction of MiniGPT's parameters does LoRA r=8 train?

**{r8.trainable_params:,} of {n:,}, that is {percent(r8.ratio_vs_full)}** ({float(r8.ratio_vs_full):.4f}).
Counted against the block Linears' weights alone it is {r8.trainable_params:,} /
{linear_weights:,} = {percent(r8.trainable_params / linear_weights)};
PEFT's `print_trainable_parameters` divides by every parameter of the wrapped model, adapter included
({n:,} + {r8.trainable_params:,} = {n + r8.trainable_params:,}), and would print
{percent(r8.trainable_params / (n + r8.trainable_params))}.
"""
    return text, shape, result


def hand_check(shape) -> str:
    """The seed's numbers worked by hand from d and d_ff, each beside the planner's own figure."""
    d, ff, r = shape.d_model, shape.d_ff, 8
    by_hand = {"weights": 4 * d * d + d * ff + ff * d, "lora": 4 * r * (d + d) + r * (d + ff) + r * (ff + d),
               "attn_w": 4 * d * d, "attn_lora": 4 * r * (d + d)}
    attn = [lin for lin in shape.linears if lin.kind == ATTENTION]
    planner = {"weights": block_linear_weights(shape), "lora": lora_trainable_params(shape, r) // shape.n_layer,
               "attn_w": sum(x.weight_params for x in attn), "attn_lora": sum(lora_params(x, r) for x in attn)}
    if by_hand != planner:
        raise SystemExit(f"hand check failed: {by_hand} != {planner}")
    attn_ratio = Fraction(by_hand["attn_lora"], by_hand["attn_w"])
    llama = preset_shape("llama-7b")
    h = llama.d_model
    l_attn = [lin for lin in llama.linears if lin.kind == ATTENTION]
    l_ratio = Fraction(sum(lora_params(x, r) for x in l_attn), sum(x.weight_params for x in l_attn))
    return f"""## Hand check: the seed's per-layer arithmetic

- Weights of one block's Linears: 4·{d}·{d} + {d}·{ff} + {ff}·{d} = {4 * d * d:,} + {d * ff:,} + {ff * d:,} =
  **{by_hand["weights"]:,}** (the planner: {planner["weights"]:,}). Biases add 4·{d} + {ff} + {d} = {4 * d + ff + d:,}
  and the two LayerNorms 2·2·{d} = {4 * d}, which the seed leaves out.
- LoRA r={r} on them: 4·{r}·({d}+{d}) + {r}·({d}+{ff}) + {r}·({ff}+{d}) = {4 * r * 2 * d:,} + {r * (d + ff):,} +
  {r * (ff + d):,} = **{by_hand["lora"]:,}** per layer (the planner: {planner["lora"]:,}),
  {percent(Fraction(by_hand["lora"], by_hand["weights"]))} of the block's weights = 18rh / 12h² = 1.5·r/h.
- Attention alone: {by_hand["attn_lora"]:,} / {by_hand["attn_w"]:,} = **{percent(attn_ratio)}**, which is 2r/h for a
  square h × h layer: r·(h + h) / h² = 2·{r}/{d}. That is large because at d_model {d} a rank of {r} is
  {Fraction(r, d)} of the width. The adapter grows like r·2h while the weight grows like h², so the ratio falls
  as 1/h: at LLaMA-7B's h = {h} the same r = {r} gives 2·{r}/{h} = {percent(Fraction(2 * r, h))} on the attention
  projections (the planner, from the llama-7b shape: {percent(l_ratio)}), {float(attn_ratio / l_ratio):.0f}× smaller.
"""


def scale_section(vocab: int, mini) -> str:
    rows = ["| model | params | LoRA r=8 params | ratio vs full FT | full FT total | LoRA r=8 total | QLoRA r=8 total |",
            "|---|---|---|---|---|---|---|"]
    plans = {}
    for name in ("minigpt", "minigpt-768", "llama-7b", "llama-70b"):
        p = plan(preset_shape(name, vocab), default_regimes([8]))
        plans[name] = p
        full, lora, qlora = p.regimes
        rows.append(f"| {name} | {p.total_params:,} | {lora.trainable_params:,} | {percent(lora.ratio_vs_full)} "
                    f"| {human(full.bytes.total)} | {human(lora.bytes.total)} | {human(qlora.bytes.total)} |")
    m, s, l70 = plans["minigpt"].regimes, plans["llama-7b"].regimes, plans["llama-70b"].regimes
    counts = param_counts(mini)
    emb = counts["token_embedding"] + counts["position_embedding"]
    simple = {h: Fraction(lora_trainable_params(simplified_shape(h, 1), 8), block_linear_weights(simplified_shape(h, 1)))
              for h in (4096, 8192)}
    gpu = 80 * 10**9  # an 80 GB accelerator, in bytes
    fits = lambda b: "fits" if b < gpu else "does not fit"
    return f"""## Ratios at MiniGPT scale and at production scale

LoRA r=8 on every block Linear, batch {B} × {T} tokens, the same assumptions for every row (MiB = 1024², GiB =
1024³ bytes; the llama rows are Meta's LLaMA-7B and Llama-2-70B shapes: SwiGLU MLPs, untied head, GQA for 70B):

{chr(10).join(rows)}

At MiniGPT scale LoRA trains a large fraction and saves little. r=8 trains {percent(m[1].ratio_vs_full)} of
the model because the ratio per block is 1.5·r/h and h is only {mini.d_model}. The memory it saves is capped by
what it does not touch: the activations ({mib(m[0].bytes.activations)}) are {percent(m[0].bytes.activations / m[0].bytes.total)}
of full fine-tuning's {mib(m[0].bytes.total)} and stay whole, and the frozen fp16 base stays in memory, so LoRA r=8
still needs {percent(m[1].bytes.total / m[0].bytes.total)} of full FT's memory and QLoRA r=8 {percent(m[2].bytes.total / m[0].bytes.total)}.
Every regime fits in a few MiB; at this size LoRA is a lesson in arithmetic, and the embeddings
({percent(emb / plans["minigpt"].total_params)} of the parameters) are untouched by it either way.

At production scale the same formula makes LoRA tiny: {percent(s[1].ratio_vs_full)} of LLaMA-7B and
{percent(l70[1].ratio_vs_full)} of Llama-2-70B (Theory 02 quotes 0.30% and 0.15%; its simplified 12h² blocks
give exactly 1.5·8/h = {percent(simple[4096])} and {percent(simple[8192])}). Memory is then dominated by the 16 bytes
per parameter of full fine-tuning: {gib(s[0].bytes.total)} for 7B, against {gib(s[1].bytes.total)} for LoRA, where the
frozen fp16 base is {percent(2 * plans["llama-7b"].total_params / s[1].bytes.total)} of the total, and {gib(s[2].bytes.total)}
for QLoRA. For 70B, QLoRA's 4-bit base ({gib(l70[2].bytes.total)}) {fits(l70[2].bytes.total)} on one 80 GB
({gib(gpu)}) GPU; LoRA ({gib(l70[1].bytes.total)}) {fits(l70[1].bytes.total)}. The activation estimate is for a
short batch; fine-tunes with long sequences add far more.
"""


def sources_section(shape) -> str:
    q = quantized_params(shape)
    fp32_absmax = shape.n_layer * sum(nf4_bytes(lin.weight_params) for lin in shape.linears)
    fp16_scale = q // 2 + 2 * (q // NF4_BLOCK)  # what "an fp16 scale per block" would cost
    dq = shape.n_layer * sum(nf4_bytes(lin.weight_params, True) for lin in shape.linears)
    dq_bits = 8 * Fraction(1, NF4_BLOCK) + 32 * Fraction(1, NF4_BLOCK * 256)
    qlora = regime_bytes(shape, Regime("qlora", 8)).weights
    k, sd = korthikanti_activation_bytes(shape, B, T), seed_activation_bytes(shape, B, T)
    return f"""## Where sources disagree, and what the code follows

- **NF4 scale.** The seed's prose stores "an fp16 scale" per block of {NF4_BLOCK}, but its arithmetic charges
  4/{NF4_BLOCK} byte per parameter, which is an fp32 absmax. The code follows the arithmetic, because that is how
  bitsandbytes stores NF4 (fp32 absmax, block size {NF4_BLOCK}) and what the QLoRA paper [2] counts (32 bits per
  {NF4_BLOCK} weights = {32 / NF4_BLOCK} bit/param). For MiniGPT's {q:,} quantized weights: fp32 absmax {fp32_absmax:,} bytes
  ({fp32_absmax / q} byte/param); an fp16 scale would give {fp16_scale:,} bytes ({fp16_scale / q} byte/param).
  QLoRA r=8's weights bucket (NF4 Linears + fp16 rest + fp16 LoRA) is {qlora:,} bytes.
- **Double quantization** (`--double-quant`): the absmax values are themselves quantized to 8 bits in blocks
  of 256 with one fp32 constant each, 8/64 + 32/(64·256) = {float(dq_bits):.4f} bit/param of overhead instead of
  {32 / NF4_BLOCK} [2]: {dq:,} bytes for the same weights. Per-tensor constants (the 16-value NF4 code, the
  double-quant offset) are a few bytes per tensor and are left out.
- **Which Linears QLoRA quantizes.** The issue stores the targeted Linears' weights in NF4, and so do
  the planner and `wrap_minigpt_qlora`; bitsandbytes' `load_in_4bit` quantizes every Linear except the
  output head, whichever modules LoRA then targets (`minituner count --quantize all-linear`). With the
  seed's all-Linear targets the two readings coincide.
- **Activations.** Korthikanti's formula gives {k / sd:.2f}× the seed's 16 bytes per (token, d_model, layer)
  here; the table follows the seed (the Lab's definition) and prints the other beside it. Neither counts
  LoRA's own small intermediate x·A.
- **Common calculator mistakes the planner avoids:** optimizer state for frozen parameters (LoRA's
  optimizer bucket holds 8 bytes per LoRA parameter only), 4-bit weights counted as half of fp16 without
  their absmax, and the maximum of the buckets where their sum is needed.
"""


def adapter_section(shape) -> str:
    lines = ["| rank | LoRA params | fp16 adapter (bytes) | KiB |", "|---|---|---|---|"]
    for r in (4, 8, 16):
        p = lora_trainable_params(shape, r)
        lines.append(f"| {r} | {p:,} | {2 * p:,} | {2 * p / 1024:,.1f} |")
    return f"""## Adapter checkpoint size (fp16)

2 bytes per LoRA parameter, plus a safetensors header of a few KiB:

{chr(10).join(lines)}
"""


REFERENCES = """## References

1. E. Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv:2106.09685:
   ΔW = B·A with A ∈ R^(r×in), B ∈ R^(out×r), r·(in + out) trainable parameters per Linear.
2. T. Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", NeurIPS 2023, arXiv:2305.14314:
   NF4, block size 64, double quantization (0.127 bit/param).
3. V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
   arXiv:2205.05198, eq. 1: s·b·h·(34 + 5·a·s/h) bytes of activations per layer.
4. S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
   arXiv:1910.02054: mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per parameter.
5. P. Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv:1710.03740: fp16 weights and
   gradients with an fp32 master copy.
"""


def build_report(vocab: int) -> tuple[str, object]:
    """REPORT.md's text and the MiniGPT plan, from the vocabulary size alone."""
    head, shape, result = minigpt_section(vocab)
    text = "\n".join([
        "# Lab 01: parameters and memory of full fine-tuning, LoRA and QLoRA on MiniGPT\n",
        "Written by `python experiments/28-lora-counts/count.py`; every number is printed by "
        "`minituner.planner` (arithmetic, no model built).\nA test regenerates this file and fails if it drifts. "
        "The same table for any model: `minituner count --preset llama-7b` or `--config config.json`.\n",
        head, scale_section(vocab, shape), hand_check(shape), sources_section(shape), adapter_section(shape),
        REFERENCES,
    ])
    return text, result


def report_vocab(tokenizer: Path) -> int:
    """vocab_size from the pretrained tokenizer if there is one, else rebuilt as pretraining builds it."""
    rebuilt = builtin_vocab_size()
    if tokenizer.is_file():
        vocab = read_vocab_size(tokenizer)
        if vocab != rebuilt:
            print(f"note: {tokenizer} holds {vocab} symbols, not the {rebuilt} of {PRETRAIN_DATA}; using {vocab}")
        return vocab
    return rebuilt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where REPORT.md and memory_breakdown.png go")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "artifacts" / "base" / "tokenizer.json",
                    help="tokenizer.json to read vocab_size from, when it exists")
    args = ap.parse_args(argv)
    text, result = build_report(report_vocab(args.tokenizer))
    print(regime_table(result))
    atomic_write_text(args.out / "REPORT.md", text)
    plot_memory_breakdown(result, args.out / "memory_breakdown.png",
                          title=f"MiniGPT ({result.total_params:,} params): memory per regime, batch {B} x {T} tokens")
    print(f"wrote {args.out / 'REPORT.md'} and {args.out / 'memory_breakdown.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

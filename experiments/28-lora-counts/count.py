"""Lab 01: trainable/frozen parameters and the four-bucket memory of MiniGPT under five regimes.

    python experiments/28-lora-counts/count.py

prints the table for MiniGPT and rewrites REPORT.md and memory_breakdown.png beside this file. Every
number comes from minituner.planner (pure arithmetic) and fills REPORT.template.md; the output is the
same on every run, before or after `minituner pretrain` (see "The model" in REPORT.md).
"""
from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from minigpt.data import PRETRAIN_DATA
from minigpt.io import atomic_write_text
from minigpt.tokenizer import read_vocab_size
from minituner.planner import (MemoryConfig, Plan, Regime, block_linear_weights, builtin_vocab_size,
                               korthikanti_activation_bytes, lora_trainable_params, param_counts, plan, preset_shape,
                               seed_activation_bytes, simplified_shape)
from minituner.planner.figures import attention_lora_ratio, hand_check, master_copy_split, nf4_overheads, scale_plans
from minituner.planner.memory import NF4_BLOCK
from minituner.planner.plot import plot_memory_breakdown
from minituner.planner.report import kinds_table, percent, regime_table

CFG = MemoryConfig()  # the seed's batch 16 x 32 tokens
B, T = CFG.batch_size, CFG.seq_len
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TEMPLATE = HERE / "REPORT.template.md"
MiB, GiB = 1024**2, 1024**3
SCALE = ("minigpt", "minigpt-768", "llama-7b", "llama-70b")
GPU = 80 * 10**9  # an 80 GB accelerator, in bytes


def mib(n: int) -> str:
    return f"{n / MiB:,.3f} MiB"


def gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def human(n: int) -> str:
    """MiB below 1 GiB, GiB above."""
    return mib(n) if n < GiB else gib(n)


def fits(n_bytes: int) -> str:
    return "fits" if n_bytes < GPU else "does not fit"


def table(header: str, rows: list[str]) -> str:
    cols = header.count("|") - 1
    return "\n".join([header, "|" + "---|" * cols, *rows])


def figures(vocab: int) -> tuple[dict, Plan]:
    """Every value REPORT.template.md names, and the MiniGPT plan (the seed's five regimes, all-linear)."""
    s = preset_shape("minigpt", vocab)
    result = plan(s)
    n, d, ff, r = result.total_params, s.d_model, s.d_ff, 8
    r8 = next(x for x in result.regimes if x.regime == Regime("lora", r)).trainable_params
    linear_weights = s.n_layer * block_linear_weights(s)
    seed_act, k_act = seed_activation_bytes(s, B, T), korthikanti_activation_bytes(s, B, T)
    plans = scale_plans(SCALE, vocab, r)
    scale_rows = [f"| {name} | {p.total_params:,} | {p.regimes[1].trainable_params:,} | "
                  f"{percent(p.regimes[1].ratio_vs_full)} | " + " | ".join(human(x.bytes.total) for x in p.regimes) + " |"
                  for name, p in plans.items()]
    m, l7, l70 = (plans[k].regimes for k in ("minigpt", "llama-7b", "llama-70b"))
    counts = param_counts(s)
    simple = {h: Fraction(lora_trainable_params(simplified_shape(h, 1), r), block_linear_weights(simplified_shape(h, 1)))
              for h in (4096, 8192)}
    hand = hand_check(s, r)
    llama = preset_shape("llama-7b")
    attn, l_attn = Fraction(hand["attn_lora"], hand["attn_w"]), attention_lora_ratio(llama, r)
    split = master_copy_split(s)
    nf4 = nf4_overheads(s, r)
    adapter_rows = [f"| {k} | {p:,} | {2 * p:,} | {2 * p / 1024:,.1f} |"
                    for k, p in ((k, lora_trainable_params(s, k)) for k in (4, 8, 16))]
    values = dict(
        s=s, vocab=vocab, pretrain_data=PRETRAIN_DATA, kinds_table=kinds_table(s), regime_table=regime_table(result),
        B=B, T=T, nf4_block=NF4_BLOCK, seed_act=seed_act, k_act=k_act, k_act_mib=mib(k_act),
        r8=r8, n=n, n_all=n + r8, r8_pct=percent(Fraction(r8, n)), r8_ratio=float(Fraction(r8, n)),
        linear_weights=linear_weights, r8_linear_pct=percent(r8 / linear_weights), r8_peft_pct=percent(r8 / (n + r8)),
        scale_table=table("| model | params | LoRA r=8 params | ratio vs full FT | full FT total | LoRA r=8 total "
                          "| QLoRA r=8 total |", scale_rows),
        m_lora_pct=percent(m[1].ratio_vs_full), m_act=mib(m[0].bytes.activations),
        m_act_pct=percent(m[0].bytes.activations / m[0].bytes.total), m_full=mib(m[0].bytes.total),
        m_lora_mem_pct=percent(m[1].bytes.total / m[0].bytes.total),
        m_qlora_mem_pct=percent(m[2].bytes.total / m[0].bytes.total),
        emb_pct=percent((counts["token_embedding"] + counts["position_embedding"]) / n),
        l7_lora_pct=percent(l7[1].ratio_vs_full), l70_lora_pct=percent(l70[1].ratio_vs_full),
        simple_4096=percent(simple[4096]), simple_8192=percent(simple[8192]),
        l7_full=gib(l7[0].bytes.total), l7_lora=gib(l7[1].bytes.total), l7_qlora=gib(l7[2].bytes.total),
        l7_base_pct=percent(2 * plans["llama-7b"].total_params / l7[1].bytes.total),
        l70_qlora=gib(l70[2].bytes.total), l70_qlora_fits=fits(l70[2].bytes.total), gpu=gib(GPU),
        l70_lora=gib(l70[1].bytes.total), l70_lora_fits=fits(l70[1].bytes.total),
        d=d, ff=ff, r=r, h=llama.d_model, hand=hand, dd4=4 * d * d, dff=d * ff, rdff=r * (d + ff),
        biases=4 * d + ff + d, norms=4 * d, lora_block_pct=percent(Fraction(hand["lora"], hand["weights"])),
        attn_pct=percent(attn), r_frac=Fraction(r, d), llama_formula_pct=percent(Fraction(2 * r, llama.d_model)),
        llama_attn_pct=percent(l_attn), attn_x=float(attn / l_attn),
        seed_w=split["weights"]["weights"], zero_w=split["optimizer"]["weights"], seed_g=split["weights"]["grads"],
        seed_o=split["weights"]["optimizer"], zero_o=split["optimizer"]["optimizer"],
        seed_total=split["weights"]["total"] - split["weights"]["activations"],
        nf4=nf4, absmax_bits=32 / NF4_BLOCK, fp32_per_param=nf4["fp32_absmax"] / nf4["quantized"],
        fp16_per_param=nf4["fp16_scale"] / nf4["quantized"],
        dq_bits=float(8 * Fraction(1, NF4_BLOCK) + 32 * Fraction(1, NF4_BLOCK * 256)), k_over_seed=k_act / seed_act,
        adapter_table=table("| rank | LoRA params | fp16 adapter (bytes) | KiB |", adapter_rows),
    )
    return values, result


def build_report(vocab: int) -> tuple[str, Plan]:
    """REPORT.md's text and the MiniGPT plan, from the vocabulary size alone."""
    values, result = figures(vocab)
    return TEMPLATE.read_text(encoding="utf-8").format_map(values), result


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

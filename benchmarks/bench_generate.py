"""Generation with the KV cache: ours with and without it, beside transformers' generate, on a real shape.

A random-weight float32 checkpoint of SmolLM2-135M's shape (real_checkpoints.py: 30 layers, d_model 576,
9 query / 3 KV heads, vocab 49,152, tied) is written to a temporary folder and loaded by both sides: ours
with ``load_base`` (minigpt.decoder.Decoder), transformers with ``AutoModelForCausalLM.from_pretrained``.
Greedy decoding of NEW tokens after a PROMPT-token prompt, batch 1, inference only, interleaved rounds.
No issue sets a goal here: the section shows what the cache buys and where ours stands against transformers.
"""
from __future__ import annotations

import tempfile

import torch

from minigpt.sampling import generate
from minituner.base_model import load_base
from real_checkpoints import SHAPES, write_checkpoint
from report import Section
from timing import fmt_ratio, time_interleaved

SHAPE = "smollm2-135m"
PROMPT, NEW = 128, 64


def run(quick: bool = False) -> Section:
    from transformers import AutoModelForCausalLM

    new = 16 if quick else NEW
    repeats = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="minituner-generate-") as tmp:
        folder = write_checkpoint(tmp, SHAPE, dtype=torch.float32)
        ours = load_base(folder)[0].eval()
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = SHAPES[SHAPE]["vocab_size"]
    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0))

    def transformers_generate() -> torch.Tensor:
        with torch.no_grad():
            return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)

    calls = {
        "ours, KV cache (minigpt.kv_cache)": lambda: generate(ours, ids, new, temperature=0),
        "ours, no cache (every step reads the whole context)": lambda: generate(ours, ids, new, temperature=0,
                                                                                use_cache=False),
        "transformers generate (its DynamicCache)": transformers_generate,
    }
    outputs = {name: fn() for name, fn in calls.items()}
    t = time_interleaved(calls, repeats=repeats, warmup=1)
    cached, plain, hf = (t[n].median_s for n in calls)
    names = list(calls)
    same = {n: bool(torch.equal(outputs[n], outputs[names[0]])) for n in names}
    section = Section(
        "Generation: the KV cache",
        f"{SHAPE}-shaped random-weight checkpoint in float32 (30 layers, d_model 576, 9/3 heads, vocab 49,152, "
        f"tied), loaded by ours (`load_base`) and by transformers (`AutoModelForCausalLM`). Greedy decoding of "
        f"{new} tokens after a {PROMPT}-token prompt, batch 1, torch.no_grad; median of {repeats} interleaved "
        "rounds after a warm-up. 'same tokens' compares each row's output with ours with the cache.",
        ["configuration", "median", "first call", "tokens/s", "vs ours with the cache", "same tokens"],
    )
    for name in names:
        section.rows.append([name, t[name].fmt(), f"{t[name].first_s:.2f} s", f"{new / t[name].median_s:.1f}",
                             fmt_ratio(t[name].median_s / cached), "yes" if same[name] else "**no**"])
    section.notes += [
        f"the cache makes ours {fmt_ratio(plain / cached)} faster here: without it each new token runs the model over "
        "the whole context (O(T) tokens per step); with it, one token's products per layer and attention over the "
        "stored keys",
        f"ours with the cache takes {fmt_ratio(cached / hf)} transformers' time: both run one token's products per "
        "layer per step; ours writes keys and values into a preallocated cache and repeats the KV heads for GQA",
    ]
    return section

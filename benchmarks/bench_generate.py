"""Generation with the KV cache: ours with and without it, beside transformers' generate, on a real shape; and what
`minituner generate --precision` computes a bf16 checkpoint in.

A random-weight float32 checkpoint of SmolLM2-135M's shape (real_checkpoints.py: 30 layers, d_model 576,
9 query / 3 KV heads, vocab 49,152, tied) is written to a temporary folder and loaded by both sides: ours
with ``load_base`` (minigpt.decoder.Decoder), transformers with ``AutoModelForCausalLM.from_pretrained``.
Greedy decoding of NEW tokens after a PROMPT-token prompt, batch 1, inference only, interleaved rounds.
No issue sets a goal here: the section shows what the cache buys and where ours stands against transformers.

The second section writes a random-weight bf16 checkpoint of Llama-3.2-1B's shape and generates from it as
`minituner generate` prepares the model: ``--precision fp32`` (``compute_in_fp32_for_generation``: the block
Linears and the head fp32 once, where that copy fits in half the memory available, as it does here) beside what
generate does where it does not fit (``compute_in_fp32(head_16bit=False)``: each block Linear cast to fp32 per
product, the head once), and ``--precision bf16`` (``compute_in_bf16``: the weights as stored, norms and the
residual stream fp32), which ``auto`` picks on a CPU with bf16 units. Without them the bf16 row is not run
(PyTorch's bf16 products there are slower than fp32 ones: not measurable here).
"""
from __future__ import annotations

import tempfile

import torch

from minigpt.bf16_support import bf16_support
from minigpt.sampling import generate
from minituner.base_model import load_base
from minituner.precision import compute_in_bf16
from minituner.memory.available import available_memory
from minituner.upcast import compute_in_fp32, compute_in_fp32_for_generation
from real_checkpoints import SHAPES, write_checkpoint
from report import Section
from timing import fmt_ratio, time_interleaved

SHAPE = "smollm2-135m"
PROMPT, NEW = 128, 64
PRECISION_SHAPE = "llama-3.2-1b"
PRECISION_PROMPT, PRECISION_NEW = 16, 16  # a token at this shape takes 0.1-0.4 s


def run(quick: bool = False) -> list[Section]:
    return [run_cache(quick), run_precision(quick)]


def run_cache(quick: bool = False) -> Section:
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


def run_precision(quick: bool = False) -> Section:
    """generate on a bf16 checkpoint of PRECISION_SHAPE: --precision fp32 against bf16 (with bf16 units only)."""
    new = 4 if quick else PRECISION_NEW
    repeats = 2 if quick else 3
    support = bf16_support("cpu")
    with tempfile.TemporaryDirectory(prefix="minituner-generate-bf16-") as tmp:
        folder = write_checkpoint(tmp, PRECISION_SHAPE, dtype=torch.bfloat16)
        fp32 = load_base(folder)[0]
        once = compute_in_fp32_for_generation(fp32, available_memory().bytes)
        how = "the block Linears and head fp32 once: the copy fits" if once else "each block Linear cast per product"
        models = {f"--precision fp32 (as generate prepares it here: {how})": fp32.eval(),
                  "informational: fp32 with each block Linear cast to fp32 per product, the head once (what generate "
                  "does where the fp32 copy does not fit in half the memory available)":
                  compute_in_fp32(load_base(folder)[0], head_16bit=False).eval()}
        if support.fast:
            models["--precision bf16 (as stored; what auto picks here)"] = compute_in_bf16(load_base(folder)[0]).eval()
    vocab = SHAPES[PRECISION_SHAPE]["vocab_size"]
    ids = torch.randint(0, vocab, (1, PRECISION_PROMPT), generator=torch.Generator().manual_seed(0))
    calls = {name: (lambda m=m: generate(m, ids, new, temperature=0)) for name, m in models.items()}
    with torch.no_grad():
        outputs = {name: fn() for name, fn in calls.items()}
        t = time_interleaved(calls, repeats=repeats, warmup=1)
    names = list(calls)
    first = t[names[0]].median_s
    section = Section(
        "Generation: a bf16 checkpoint in fp32 or as stored",
        f"{PRECISION_SHAPE}-shaped random-weight checkpoint in bf16 (16 layers, d_model 2,048, 32/8 heads, vocab "
        f"128,256, tied), prepared as `minituner generate` prepares it for each --precision. Greedy decoding of {new} "
        f"tokens after a {PRECISION_PROMPT}-token prompt with the KV cache, batch 1, torch.no_grad; median of "
        f"{repeats} interleaved rounds after a warm-up. CPU bf16 units: {support.reason}. 'same tokens' compares "
        "with the first row (bf16 products round otherwise, so greedy choices may part where two logits are close).",
        ["--precision", "median", "s a token", "tokens/s", "vs the first row", "same tokens"],
    )
    for name in names:
        section.rows.append([name, t[name].fmt(), f"{t[name].median_s / new:.3f}", f"{new / t[name].median_s:.1f}",
                             fmt_ratio(t[name].median_s / first),
                             "yes" if torch.equal(outputs[name], outputs[names[0]]) else "no"])
    if not support.fast:
        section.notes.append("bf16: not measurable here (no bf16 units: `generate --precision auto` computes in fp32 "
                             "on this CPU)")
    return section

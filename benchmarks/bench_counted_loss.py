"""Instruction data: the head and the loss run on the counted targets alone (minigpt.train.counted_logits).

In an instruction or chat set the prompt's targets (and the padding's) do not count (-100). Full logits compute
the head's product for every position and the loss then ignores most of them; ``lm_loss`` runs the head on the
counted rows only. The loss and every gradient are the same (tests/minigpt/test_counted_logits.py); the head's
product, the loss and the logits kept for backward shrink with the counted fraction.

The model: a Qwen2.5-0.5B-shaped random-weight bf16 checkpoint (24 layers, d_model 896, 14 query / 2 KV heads,
vocab 151,936, tied), a small model with a large vocabulary, where the head is a large share of the step. It is
loaded and built as ``finetune --method qlora`` builds it on CPU: ``load_base`` with every block Linear NF4 as
read, ``build_for_training`` QLoRA r = 16 on all-linear, fp32 compute; batch 1 × 512; one AdamW step per call.
"""
from __future__ import annotations

import tempfile

import torch

from minigpt.cross_entropy import IGNORE_INDEX, cross_entropy
from minigpt.train import lm_loss
from real_checkpoints import SHAPES, write_checkpoint
from report import Section
from timing import MIB, OPTIMIZER_NOTE, adamw, fmt_ratio, fmt_seconds, time_interleaved

SHAPE = "qwen2.5-0.5b"
SEQ = 512
RANK, ALPHA = 16, 32.0
SCHEME = "nf4_per_group_64"
COUNTED = {"every target counts": 1.0, "the last half counts (a 256-token prompt)": 0.5,
           "the last quarter counts (a 384-token prompt)": 0.25}


def full_logits_loss(model, x, y):
    """The loss as computed before counted_logits: logits for every position, the uncounted ignored."""
    return cross_entropy(model(x), y)


def _model(folder):
    from minituner.base_model import load_base
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    model = load_base(folder, quantize=("all-linear", SCHEME))[0]
    torch.manual_seed(0)
    build_for_training(model, "qlora", LoRAConfig(r=RANK, alpha=ALPHA, target_modules="all-linear"), SCHEME,
                       device="cpu", compute_dtype=torch.float32)
    return model


def _linear_flops_share_of_head(cfg: dict) -> float:
    """The head's share of the step's Linear products (forward + input gradient are each 2·N per weight)."""
    c, f, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    head_dim = c // cfg["num_attention_heads"]
    per_layer = 2 * c * c + 2 * c * kv * head_dim + 3 * c * f
    head = c * cfg["vocab_size"]
    return head / (head + cfg["num_hidden_layers"] * per_layer)


def _saved_mib(model, loss_fn, x, y) -> float:
    from minituner.memory.check import SavedTensors

    model.zero_grad(set_to_none=True)
    with SavedTensors(model) as saved:
        loss = loss_fn(model, x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes / MIB


def run(quick: bool = False) -> Section:
    cfg = SHAPES[SHAPE]
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="minituner-counted-") as tmp:
        model = _model(write_checkpoint(tmp, SHAPE))
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(1)
    x, y_all = torch.randint(0, vocab, (1, SEQ), generator=g), torch.randint(0, vocab, (1, SEQ), generator=g)
    batches = {}
    for name, fraction in COUNTED.items():
        y = y_all.clone()
        y[:, : SEQ - int(SEQ * fraction)] = IGNORE_INDEX  # the prompt's targets
        batches[name] = y
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(loss_fn, y):
        def call():
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return call

    calls, labels = {}, {}
    for name, y in batches.items():
        calls[f"{name}: counted rows (lm_loss)"] = step(lm_loss, y)
        labels[f"{name}: counted rows (lm_loss)"] = (name, "head on the counted rows (lm_loss)", lm_loss)
        if COUNTED[name] < 1.0:
            calls[f"{name}: full logits"] = step(full_logits_loss, y)
            labels[f"{name}: full logits"] = (name, "full logits (before)", full_logits_loss)
    with torch.no_grad():  # the two losses agree on every batch before anything is timed
        for name, y in batches.items():
            a, b = lm_loss(model, x, y), full_logits_loss(model, x, y)
            if not torch.allclose(a, b, rtol=1e-5):
                raise AssertionError(f"{name}: lm_loss {a.item()} != full-logits loss {b.item()}")
    saved = {key: _saved_mib(model, fn, x, batches[name]) for key, (name, _, fn) in labels.items()}
    t = time_interleaved(calls, repeats=repeats, warmup=1)
    section = Section(
        "Instruction data: the head on the counted targets alone",
        f"A {SHAPE}-shaped random-weight bf16 checkpoint (24 layers, d_model 896, 14/2 heads, vocab 151,936, tied; "
        f"the head is {100 * _linear_flops_share_of_head(cfg):.0f}% of the step's Linear products) loaded and "
        f"built as `finetune --method qlora` does on CPU (NF4 all-linear as read, LoRA r = {RANK}, fp32 compute), "
        f"batch 1 × {SEQ}, one AdamW step per call ({OPTIMIZER_NOTE}); median of {repeats} interleaved rounds after a warm-up. "
        "Targets before the answer do not count (-100), as an instruction set's prompt. 'full logits' is the loss "
        "as computed before `minigpt.train.counted_logits`: the head on every position. 'vs full logits' divides "
        "by the same batch's full-logits step. 'saved for backward' is what the forward and the loss keep "
        "(`memory.check.SavedTensors`, as memory-check counts it). Both losses are checked equal first.",
        ["targets", "loss", "median step", "first call", "vs full logits", "saved for backward"],
    )
    for key, (name, how, _) in labels.items():
        full = f"{name}: full logits"
        ratio = t[key].median_s / t[full].median_s if full in t else 1.0
        section.rows.append([name, how, t[key].fmt(), fmt_seconds(t[key].first_s), fmt_ratio(ratio),
                             f"{saved[key]:,.0f} MiB"])
    return section

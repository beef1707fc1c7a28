"""`minituner eval`'s numbers: mean loss over the counted tokens of a data set, its perplexity, and the counts.

Instruction data (.jsonl/.json/.parquet/.arrow, builtin:forecast-qa) counts what training counts (by default the
answers and their EOS; ``train_on_inputs`` every token); plain text counts every token of non-overlapping windows of
``block_size`` tokens (the tail shorter than a window is left out). ``minituner eval`` takes the window finetune
trained and validated with (the adapter run's ``--seq-len``, else finetune's default), or ``--seq-len``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.data import load_documents, split_documents
from minigpt.errors import InputError
from minigpt.train import evaluate

from .sft import (DataSelection, EvalResult, SFTConfig, evaluate_examples, is_sft_source, load_chat_template, plain_text_only,
                  prepare_eval)

SPLITS = ("train", "val", "test", "all")


def text_split(source: str, split: str) -> str:
    """One split of a text corpus as training splits it (minigpt.data.split_documents), or all of it."""
    if split == "all":
        return "\n\n".join(load_documents(source))
    return getattr(split_documents(load_documents(source)), split)


@torch.no_grad()
def evaluate_text(model: nn.Module, ids: torch.Tensor, block_size: int, batch_size: int = 32) -> EvalResult:
    """Mean loss over every token of the non-overlapping windows of `ids` (each window one "example")."""
    windows = (ids.numel() - 1) // block_size
    if windows < 1:
        raise InputError(f"{ids.numel()} tokens: fewer than one window of {block_size + 1}")
    loss = evaluate(model, ids, block_size, batch_size, max_batches=math.ceil(windows / batch_size))
    return EvalResult(loss, math.exp(loss) if loss < 700 else math.inf, windows, windows * block_size)


def evaluate_data(model: nn.Module, tokenizer, base: str | Path, source: str, split: str = "all",
                  fmt: str | None = None, sft_cfg: SFTConfig | None = None, batch_size: int = 32,
                  block_size: int | None = None, log=print, template_file: Path | None = None,
                  selection: DataSelection = DataSelection()) -> EvalResult:
    """Loss, perplexity, examples and counted tokens of `model` on one split of `source` (or all of it); chats
    rendered with the base's chat template, or `template_file`'s (a run's chat_template.jinja)."""
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    block = block_size or model.config.block_size
    if not is_sft_source(source):
        plain_text_only(source, fmt, template_file, selection)
        ids = torch.tensor(tokenizer.encode(text_split(source, split)), dtype=torch.long)
        return evaluate_text(model, ids, block, batch_size)
    template = load_chat_template(base, template_file)
    examples, stats = prepare_eval(source, tokenizer, template, block, sft_cfg, fmt, None if split == "all" else split,
                                   selection)
    warning = stats.warning(block + 1)
    if warning:
        log(f"{warning}; {stats.summary()}")
    return evaluate_examples(model, examples, batch_size)

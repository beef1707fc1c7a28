"""Batches of tokenized examples (right padding, masked labels) and evaluation over the counted tokens.

A batch is ``(x, y)``, each (B, T) long: ``x`` the input ids, ``y`` the next-token targets, IGNORE (-100) where
the target does not count or is padding. It is the contract of ``minigpt.data.sample_batch``, so
``minigpt.train.lm_loss`` (``minigpt.cross_entropy``, whose ignore index is -100) is already the masked mean over the
counted targets. Every example holds at least one counted token (tokenize_records drops the others), so no batch
is all -100.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from minigpt.cross_entropy import cross_entropy
from minigpt.errors import InputError
from minigpt.train import counted_logits, eval_rows, vocab_size_of

from .examples import IGNORE, Example


def collate(examples: Sequence[Example], pad_id: int = 0,
            length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (B, T): T is the longest example less one, or `length`; padding on the right, its targets IGNORE."""
    if not examples:
        raise InputError("no examples to batch")
    T = max(len(e.input_ids) for e in examples) - 1
    if length is not None:
        if length < T:
            raise InputError(f"an example needs {T} positions, more than length {length}")
        T = length
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.input_ids) - 1
        x[b, :n] = torch.tensor(e.input_ids[:-1], dtype=torch.long)
        y[b, :n] = torch.tensor(e.labels[1:], dtype=torch.long)
    return x, y  # (B, T), (B, T)


def iter_batches(examples: Sequence[Example], batch_size: int, seed: int | None = 0, pad_id: int = 0,
                 length: int | None = None, drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One pass over the examples in batches; shuffled by torch.randperm from `seed` (None: in order)."""
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    order = (torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
             if seed is not None else list(range(len(examples))))
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        if drop_last and len(chunk) < batch_size:
            return
        yield collate([examples[j] for j in chunk], pad_id, length)


@dataclass(frozen=True)
class LargestBatch:
    """The largest batch of `batch_size` examples a run can draw from a data set, for the memory planner: no batch
    is wider (``seq_len`` positions: the longest example, less the one it does not predict) or counts more
    targets (``counted``: the most-counted example drawn every time, as ExampleSampler draws with replacement).
    ``mean_counted`` is what an average batch counts."""

    batch_size: int
    seq_len: int
    counted: int
    mean_counted: float


def largest_batch(examples: Sequence[Example], batch_size: int) -> LargestBatch:
    """The widest and most-counted batch of `batch_size` examples drawn from `examples` (see LargestBatch)."""
    if not examples:
        raise InputError("no examples to batch")
    seq_len = max(len(e.input_ids) for e in examples) - 1
    most = max(e.counted for e in examples)  # labels[0] never counts: every counted label is a target of y
    mean = sum(e.counted for e in examples) / len(examples)
    return LargestBatch(batch_size, seq_len, batch_size * most, batch_size * mean)


class ExampleSampler:
    """Random batches drawn with replacement from a torch.Generator, as minigpt.data.sample_batch draws windows.

    ``sampler(batch_size, generator)`` replaces ``sample_batch(train_ids, batch_size, block_size, generator)``;
    the draw consumes the generator the same way on every rank, so resuming from a checkpointed generator state
    and torchrun's shard() of the global batch work unchanged.
    """

    def __init__(self, examples: Sequence[Example], pad_id: int = 0, length: int | None = None) -> None:
        if not examples:
            raise InputError("no examples to train on")
        self.examples, self.pad_id, self.length = list(examples), pad_id, length

    def __len__(self) -> int:
        return len(self.examples)

    def __call__(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.examples), (batch_size,), generator=generator)
        return collate([self.examples[i] for i in ix.tolist()], self.pad_id, self.length)


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy (nats) over the counted tokens
    perplexity: float  # exp(loss)
    examples: int
    tokens: int  # counted tokens

    def as_dict(self) -> dict:
        """The object `minituner eval --json` prints."""
        return {"loss": self.loss, "perplexity": self.perplexity, "examples": self.examples, "tokens": self.tokens}


@torch.no_grad()
def evaluate_examples(model: nn.Module, examples: Sequence[Example], batch_size: int = 32, pad_id: int = 0,
                      device: str | torch.device | None = None) -> EvalResult:
    """Mean loss over every counted token of `examples` (in order; ``minigpt.train.counted_logits``)."""
    if not examples:
        raise InputError("no examples to evaluate")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in iter_batches(examples, batch_size, seed=None, pad_id=pad_id):
            for x, y in eval_rows(*batch, vocab_size_of(model)):  # the logits under EVAL_LOGITS_BYTES at once
                y = y.to(device)
                total += cross_entropy(*counted_logits(model, x.to(device), y), reduction="sum").item()
                count += int((y != IGNORE).sum())
    finally:
        model.train(was_training)
    loss = total / count
    return EvalResult(loss, math.exp(loss) if loss < 700 else math.inf, len(examples), count)

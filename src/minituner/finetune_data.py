"""What `finetune` trains on: windows of plain text, or instruction examples whose labels count the answers only.

``training_data`` reads ``--data`` once and returns a TrainingData, the arguments minigpt.train.train needs
(token ids, or a batch sampler, a validation loss and the data's identity) plus the figures a run reports.
Plain text (``.txt``, folders of it, ``builtin:forecasts``) keeps the windowed path; ``.jsonl`` / ``.json`` and
``builtin:forecast-qa`` go through minituner.sft: the base's chat template (or the default one), answer-only
labels (``train_on_inputs`` counts everything), truncation or dropping of overlong examples, always reported.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.data import encode_split, load_documents, split_documents
from minigpt.errors import InputError
from minigpt.train import TrainConfig, evaluate

from .base_model import base_tokenizer
from .sft import (ChatTemplate, DataSelection, ExampleSampler, LargestBatch, SFTConfig, evaluate_examples,
                  examples_sha256, is_sft_source, largest_batch, load_chat_template, load_records, plain_text_only,
                  prepare_sft, record_pieces, split_names)
from .sft.dataset_card import card_config_name


@dataclass
class TrainingData:
    """The data of a run, in the form minigpt.train.train takes it."""

    description: str  # one line for the log: how much data, from where
    train_size: int  # what --epochs counts: train tokens (text) or train examples (instruction data)
    per_step: int  # how much of train_size one batch consumes (a step: grad_accum of them)
    val_loss: Callable[[nn.Module], float]  # validation loss (nats per counted token)
    train_ids: torch.Tensor | None = None  # text: token ids, windows drawn by sample_batch
    val_ids: torch.Tensor | None = None
    batches: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None  # instruction data
    data_identity: dict | None = None  # instruction data: what checkpoints record of it (sha256 of the examples)
    largest: LargestBatch | None = None  # the largest batch, training's or evaluation's (sft.largest_batch): planned
    unk_fraction: float = 0.0  # fraction of the characters the base tokenizer never saw
    results: dict = field(default_factory=dict)  # figures for manifest.json["results"]
    template: ChatTemplate | None = None  # instruction data: the chat template it was rendered with

    def steps_for_epochs(self, epochs: float, grad_accum: int = 1) -> int:
        """Optimizer steps for `epochs` passes, each step `grad_accum` batches."""
        return steps_for_epochs(epochs, self.train_size, self.per_step * grad_accum)


def steps_for_epochs(epochs: float, train_size: int, batch_size: int, block_size: int = 1) -> int:
    """Optimizer steps for `epochs` passes over `train_size` tokens (or examples, block_size 1), at least one."""
    return max(1, math.ceil(epochs * train_size / (batch_size * block_size)))


def encode_domain(source: str, tokenizer, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and val token ids of a corpus, encoded with the base's tokenizer."""
    splits = split_documents(load_documents(source))
    return (encode_split(splits.train, tokenizer, block_size, "train"),
            encode_split(splits.val, tokenizer, block_size, "val"))


def domain_unknown_fraction(source: str, tokenizer) -> float:
    """The fraction of the characters of a corpus's val split (what ``encode_domain`` evaluates on) that the
    tokenizer reads as unknown: the forgetting check's loss means little on text mostly <unk>."""
    return unknown_fraction([split_documents(load_documents(source)).val], tokenizer, source, allow=True)


def unknown_fraction(pieces: Sequence[str], tokenizer, source: str, allow: bool) -> float:
    """The fraction of the characters of `pieces` that encode to the unknown token; refuses any unless `allow`.

    Each piece is checked as training encodes it, on its own (a prompt, a completion, the EOS token), so that
    a word-level vocabulary is not shown words glued across pieces (``'</s>calm'``) that training never reads."""
    unseen = [tokenizer.unseen_characters(piece) for piece in pieces]
    distinct = sorted(set().union(*unseen))
    if distinct and not allow:
        what = "characters" if all(len(u) == 1 for u in distinct) else "pieces of text"
        raise InputError(f"{source}: {len(distinct)} {what} the base tokenizer never saw "
                         f"({', '.join(map(repr, distinct[:5]))}{', ...' if len(distinct) > 5 else ''}); they would train "
                         "as <unk>: clean the data, or pass --allow-unknown-chars to train anyway")
    unknown = sum(piece.count(u) * len(u) for piece, us in zip(pieces, unseen) for u in us)
    return unknown / max(1, sum(map(len, pieces)))


def text_data(source: str, tokenizer, block_size: int, train_cfg: TrainConfig, allow_unknown: bool) -> TrainingData:
    """Plain text: random windows of the train split, validation on fixed windows of the val split."""
    train_ids, val_ids = encode_domain(source, tokenizer, block_size)
    unk = unknown_fraction(["\n\n".join(load_documents(source))], tokenizer, source, allow_unknown)
    return TrainingData(
        f"{train_ids.numel():,} train / {val_ids.numel():,} val tokens from {source}", train_ids.numel(),
        train_cfg.batch_size * block_size,
        lambda m: evaluate(m, val_ids, block_size, train_cfg.batch_size, train_cfg.eval_batches),
        train_ids=train_ids, val_ids=val_ids, unk_fraction=unk,
        largest=text_batch(train_cfg.batch_size, block_size),
        results={"train_tokens": train_ids.numel(), "val_tokens": val_ids.numel()})


def text_batch(batch_size: int, window: int) -> LargestBatch:
    """Plain text's batches: windows of `window` tokens whose every target counts."""
    return LargestBatch(batch_size, window, batch_size * window, float(batch_size * window))


def sft_data(source: str, base: Path, tokenizer, block_size: int, train_cfg: TrainConfig, fmt: str | None,
             sft_cfg: SFTConfig, allow_unknown: bool, log=print, template_file: Path | None = None,
             selection: DataSelection = DataSelection()) -> TrainingData:
    """Instruction data: padded batches of whole examples, validation over the val split's counted tokens;
    rendered with the base's chat template, or `template_file`'s."""
    template = load_chat_template(base, template_file)
    records = load_records(source, fmt, selection)
    pieces = [text for r in records for text, _ in record_pieces(r, template)]  # as encoded: template, EOS included
    unk = unknown_fraction(pieces, tokenizer, source, allow_unknown)
    data = prepare_sft(source, tokenizer, template, block_size, sft_cfg, fmt, records=records)
    for name, stats in (("train", data.train_stats), ("val", data.val_stats)):
        log(f"{name}: {stats.summary()}")
        warning = stats.warning(block_size + 1)
        if warning:
            log(warning.replace("warning: ", f"warning: {name}: ", 1))
    val, batch_size = data.val, train_cfg.batch_size
    formats, named = sorted({r.format for r in records}), split_names(records)
    carved = "" if "val" in named else " (val carved from train)"
    config = card_config_name(source, selection.config)
    named_by = f"config {config!r} of its dataset card names" if config else "its files name"
    mapped = f" (--data-split {','.join(f'{a}={b}' for a, b in selection.splits)})" if selection.splits else ""
    splits = f"; splits as {named_by} them: {', '.join(named)}{mapped}{carved}" if named else ""
    return TrainingData(
        f"{len(data.train):,} train / {len(data.val):,} val examples ({', '.join(formats)}; "
        f"{data.train_stats.counted_tokens:,} counted train tokens) from {source}{splits}; "
        f"chat template: {template.origin}",
        len(data.train), batch_size,
        lambda m: evaluate_examples(m, val, batch_size).loss,
        batches=ExampleSampler(data.train), unk_fraction=unk,
        largest=largest_batch([*data.train, *val], batch_size),  # evaluation batches val at the same size
        data_identity={"train_examples_sha256": examples_sha256(data.train),
                       "val_examples_sha256": examples_sha256(data.val)},
        results={"train_tokens": data.train_stats.tokens, "val_tokens": data.val_stats.tokens,
                 "sft": {"formats": formats, **({"named_splits": named} if named else {}),
                         **({"data_config": config} if config else {}),
                         "template": template.origin, "eos_token": template.eos_token,
                         "train_on_inputs": sft_cfg.train_on_inputs, "overlong": sft_cfg.overlong,
                         "train": data.train_stats.as_dict(), "val": data.val_stats.as_dict()}},
        template=template)


def largest_data_batch(source: str, base: Path, window: int, batch_size: int, fmt: str | None = None,
                       sft_cfg: SFTConfig | None = None, template_file: Path | None = None,
                       selection: DataSelection = DataSelection()) -> tuple[LargestBatch, str | None]:
    """The largest batch `finetune --base base --data source` makes, for the memory planner, and a note when
    finetune would refuse the data (characters its tokenizer never saw) or None. Instruction data is read,
    templated and tokenized as finetune reads it (examples cut or dropped at `window`), then ``sft.largest_batch``
    over its train and val splits: training draws the first, evaluation batches the second at the same batch
    size. Plain text: windows of `window` tokens whose every target counts."""
    if not is_sft_source(source):
        plain_text_only(source, fmt, template_file, selection)
        docs = load_documents(source)
        return text_batch(batch_size, window), _refusal(["\n\n".join(docs)], base_tokenizer(base), source)
    tokenizer, template = base_tokenizer(base), load_chat_template(base, template_file)
    records = load_records(source, fmt, selection)
    data = prepare_sft(source, tokenizer, template, window, sft_cfg or SFTConfig(), fmt, records=records)
    pieces = [text for r in records for text, _ in record_pieces(r, template)]  # as sft_data checks them
    return largest_batch([*data.train, *data.val], batch_size), _refusal(pieces, tokenizer, source)


def _refusal(pieces: Sequence[str], tokenizer, source: str) -> str | None:
    """Why finetune would refuse this text (unknown_fraction's message, without --allow-unknown-chars), or None."""
    try:
        unknown_fraction(pieces, tokenizer, source, allow=False)
    except InputError as e:
        return f"finetune would refuse this data: {e}"
    return None


def training_data(source: str, base: Path, tokenizer, block_size: int, train_cfg: TrainConfig, fmt: str | None = None,
                  sft_cfg: SFTConfig | None = None, allow_unknown: bool = False, log=print,
                  template_file: Path | None = None, selection: DataSelection = DataSelection()) -> TrainingData:
    """The data of `finetune --data SOURCE`: instruction data (is_sft_source) or plain text."""
    if is_sft_source(source):
        return sft_data(source, base, tokenizer, block_size, train_cfg, fmt, sft_cfg or SFTConfig(), allow_unknown, log,
                        template_file, selection)
    plain_text_only(source, fmt, template_file, selection)
    return text_data(source, tokenizer, block_size, train_cfg, allow_unknown)

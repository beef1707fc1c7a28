"""Tokenize records into training examples whose labels count only the answers.

An example is ``input_ids`` and ``labels`` of the same length, aligned as in Hugging Face (the model shifts):
``labels[i]`` is ``input_ids[i]`` where token i counts in the loss and -100 where it does not. By default only
the completion, or each assistant turn, counts, together with the token that ends it (TRL's completion-only and
assistant-only losses, axolotl's ``train_on_inputs: false``); ``train_on_inputs=True`` counts every token.
``labels[0]`` is always -100: no token predicts the first one.

What counts (``record_answers``: the string a record trains on and the character spans that count): a text
counts whole; a prompt-completion counts its completion. Either ends with the EOS (added only where it does not
end with it already), tokenized on its own as TRL appends the EOS id, and starts with what the tokenizer itself
puts before text (``special_prefix``: Llama's BOS), uncounted, as ``tokenizer(text)`` in TRL, added only where the
text does not start with it already (text rendered with a chat template writes its own BOS; tokenizer(text) would
then give two). A chat counts its
answers, found as ``sft.answers`` says; a turn with no end marker still counts (SFTStats.without_eos says how
often); TRL's conversational prompt-completion counts the completion's turns only (``Record.answers_from``).

How they are tokenized: the whole string at once, as transformers' ``apply_chat_template(tokenize=True)`` and TRL
do, so the ids are theirs (a SentencePiece tokenizer adds no "▁" at piece boundaries, BPE merges across them as
there), and a token counts where its characters overlap an answer (``offset_encoder``). A tokenizer without
offsets (MiniGPT's characters, where pieces and the whole tokenize alike) is encoded piece by piece.

The EOS: HF tokenizers encode their ``eos_token`` text (``<|im_end|>``, ``<|eot_id|>``, ``</s>``) to one id.
MiniGPT's character tokenizer has none: answers end with the text ``<|end|>`` (templates.DEFAULT_EOS), 7 tokens.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

from minigpt.cross_entropy import IGNORE_INDEX
from minigpt.errors import InputError

from .answers import Span, chat_answers
from .encoders import offset_encoder, plain_encoder, special_prefix
from .formats import Record
from .templates import ChatTemplate

IGNORE = IGNORE_INDEX  # label of a token that does not count (-100, as torch's cross_entropy)
OVERLONG = ("truncate", "drop")


@dataclass
class SFTConfig:
    train_on_inputs: bool = False  # count prompt, system and user tokens in the loss too (default: answers only)
    overlong: str = "truncate"  # an example longer than block_size + 1 tokens: "truncate" (keep its start) or "drop"

    def validate(self) -> None:
        if self.overlong not in OVERLONG:
            raise InputError(f"overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}")


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # aligned with input_ids; IGNORE where the token does not count
    where: str = ""  # "file:line" of the record
    without_eos: bool = False  # an assistant turn of this chat does not end with the template's eos_token

    @property
    def counted(self) -> int:
        """Tokens that count in the loss."""
        return sum(1 for t in self.labels if t != IGNORE)


@dataclass
class SFTStats:
    records: int = 0  # records tokenized
    examples: int = 0  # examples kept
    truncated: int = 0  # kept, cut to block_size + 1 tokens
    dropped: int = 0  # longer than block_size + 1 and dropped (overlong="drop")
    dropped_empty: int = 0  # no counted token left (after truncation, or a one-token text), so dropped
    without_eos: int = 0  # chats with an assistant turn where the template wrote no eos_token (the turn still counts)
    tokens: int = 0  # tokens of the kept examples
    counted_tokens: int = 0  # of which count in the loss
    longest: int = 0  # tokens of the longest record before truncation
    dropped_where: list[str] = field(default_factory=list)  # "file:line" of the first dropped records (10 at most)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for logs and manifests."""
        line = (f"{self.examples} of {self.records} examples, {self.counted_tokens} counted of {self.tokens} tokens; "
                f"{self.truncated} truncated, {self.dropped + self.dropped_empty} dropped "
                f"(longest {self.longest} tokens)")
        if self.without_eos:
            line += f"; {self.without_eos} chats with a turn the template ends without EOS"
        return line

    def warning(self, window: int) -> str | None:
        """One line saying which examples were cut or dropped and why (window: block_size + 1 tokens); None when
        every example was kept whole."""
        if not (self.truncated or self.dropped or self.dropped_empty):
            return None
        parts = [f"{self.truncated} examples longer than {window} tokens truncated (their start kept)"] \
            if self.truncated else []
        if self.dropped:
            parts.append(f"{self.dropped} examples longer than {window} tokens dropped (--overlong drop)")
        if self.dropped_empty:
            parts.append(f"{self.dropped_empty} dropped with no trained token inside the window (a prompt that "
                         "fills it, or a one-token text)")
        where = f" (first dropped: {', '.join(self.dropped_where[:3])})" if self.dropped_where else ""
        return "warning: " + ", ".join(parts) + where


def record_answers(record: Record, template: ChatTemplate) -> tuple[str, list[Span]]:
    """The string a record trains on and the spans that count: a text + EOS, all of it; a prompt and its
    completion + EOS, the completion; a chat, its answers (chat_answers). The EOS is added only where the text
    does not end with it already (as TRL appends it)."""
    eos = template.eos_token
    if record.kind == "chat":
        return chat_answers(list(record.messages), template, record.where, record.answers_from)
    prompt, answer = ("", record.text) if record.kind == "text" else (record.prompt, record.completion)
    text = prompt + answer + ("" if answer.endswith(eos) else eos)
    return text, [(len(prompt), len(text))]


def _pieces(text: str, spans: Sequence[Span]) -> list[tuple[str, bool]]:
    pieces, pos = [], 0
    for a, b in spans:
        pieces += [(text[pos:a], False), (text[a:b], True)]
        pos = b
    pieces.append((text[pos:], False))
    return [(t, answer) for t, answer in pieces if t]


def chat_pieces(messages: list[dict], template: ChatTemplate, where: str = "") -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_answer) pieces; their concatenation is template.render(messages)."""
    return _pieces(*chat_answers(messages, template, where))


def _body_and_tail(record: Record, template: ChatTemplate) -> tuple[str, list[Span], str]:
    """record_answers split as tokenize_record encodes it: a chat whole (no tail); a text or completion without its
    final EOS, which is encoded on its own so that it never merges into the last word (TRL appends the EOS id)."""
    text, spans = record_answers(record, template)
    if record.kind == "chat":
        return text, spans, ""
    eos = template.eos_token
    body = text[:-len(eos)]
    return body, [(a, min(b, len(body))) for a, b in spans if a < len(body)], eos


def record_pieces(record: Record, template: ChatTemplate) -> list[tuple[str, bool]]:
    """(text, is_answer) pieces of a record as tokenize_record encodes them: the answers cut out of the rendered
    chat, or a text's or completion's pieces and then its EOS."""
    body, spans, tail = _body_and_tail(record, template)
    return _pieces(body, spans) + ([(tail, True)] if tail else [])


def record_text(record: Record, template: ChatTemplate) -> str:
    """The whole string a record trains on (for checks such as characters a tokenizer never saw)."""
    return record_answers(record, template)[0]


def _in_answer(a: int, b: int, spans: Sequence[Span]) -> bool:
    """A token of characters [a, b) counts if it overlaps an answer (transformers' char_to_token marks a token that
    straddles an answer's edge); a token of no characters, if it sits inside one."""
    if a == b:
        return any(s <= a < e for s, e in spans)
    return any(a < e and b > s for s, e in spans)


def tokenize_record(record: Record, encode: Callable[[str], list[int]], template: ChatTemplate,
                    train_on_inputs: bool = False, prefix_ids: Sequence[int] = (),
                    encode_offsets: Callable[[str], tuple[list[int], list[Span]]] | None = None) -> Example:
    """One record as an Example (untruncated); `prefix_ids` (special_prefix) start a text or prompt-completion.

    With `encode_offsets` (offset_encoder) the whole string is tokenized at once, as transformers'
    apply_chat_template(tokenize=True) and TRL tokenize it, and a token counts where its characters overlap an
    answer; without (MiniGPT's characters), piece by piece."""
    text, spans, tail = _body_and_tail(record, template)
    ids: list[int] = [] if record.kind == "chat" else list(prefix_ids)
    labels: list[int] = [IGNORE] * len(ids)
    if encode_offsets is not None:
        tokens, offsets = encode_offsets(text)
        ids += tokens
        labels += [t if train_on_inputs or _in_answer(a, b, spans) else IGNORE for t, (a, b) in zip(tokens, offsets)]
    else:
        for piece, answer in _pieces(text, spans):
            piece_ids = list(encode(piece))
            ids += piece_ids
            labels += piece_ids if (answer or train_on_inputs) else [IGNORE] * len(piece_ids)
    tail_ids = list(encode(tail)) if tail else []
    ids += tail_ids
    labels += tail_ids
    n = len(prefix_ids) if record.kind != "chat" else 0
    if n and ids[n:2 * n] == list(prefix_ids):  # the text starts with the prefix itself: not twice
        ids, labels = ids[n:], labels[n:]
    if labels:
        labels[0] = IGNORE  # nothing predicts the first token
    without_eos = record.kind == "chat" and any(not text[a:b].endswith(template.end_markers) for a, b in spans)
    return Example(ids, labels, record.where, without_eos)


def tokenize_records(records: Iterable[Record], tokenizer, template: ChatTemplate, block_size: int,
                     cfg: SFTConfig | None = None) -> tuple[list[Example], SFTStats]:
    """Examples of at most block_size + 1 tokens (block_size predictions each) and what happened on the way.

    A longer example is truncated (its start kept) or dropped, per cfg.overlong; one whose truncation leaves no
    counted token is dropped too. Both are counted in the stats, never silently.
    """
    cfg = cfg or SFTConfig()
    cfg.validate()
    if block_size < 1:
        raise InputError(f"block_size must be >= 1, got {block_size}")
    encode, prefix, offsets = plain_encoder(tokenizer), special_prefix(tokenizer), offset_encoder(tokenizer)
    limit = block_size + 1
    examples, stats = [], SFTStats()
    for record in records:
        ex = tokenize_record(record, encode, template, cfg.train_on_inputs, prefix, offsets)
        stats.records += 1
        stats.without_eos += ex.without_eos
        stats.longest = max(stats.longest, len(ex.input_ids))
        if len(ex.input_ids) > limit:
            if cfg.overlong == "drop":
                stats.dropped += 1
                _note(stats, ex)
                continue
            ex = Example(ex.input_ids[:limit], ex.labels[:limit], ex.where, ex.without_eos)
            if ex.counted == 0:
                stats.dropped_empty += 1
                _note(stats, ex)
                continue
            stats.truncated += 1
        if ex.counted == 0:  # e.g. a one-token text: nothing to learn
            stats.dropped_empty += 1
            _note(stats, ex)
            continue
        examples.append(ex)
        stats.examples += 1
        stats.tokens += len(ex.input_ids)
        stats.counted_tokens += ex.counted
    return examples, stats


def examples_sha256(examples: Iterable[Example]) -> str:
    """sha256 of the examples' ids and labels, in order: the data's identity in a run's checkpoints."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.input_ids, e.labels], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def _note(stats: SFTStats, ex: Example) -> None:
    if len(stats.dropped_where) < 10:
        stats.dropped_where.append(ex.where)

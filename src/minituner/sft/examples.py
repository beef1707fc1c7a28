"""Tokenize records into training examples whose labels count only the answers.

An example is ``input_ids`` and ``labels`` of the same length, aligned as in Hugging Face (the model shifts):
``labels[i]`` is ``input_ids[i]`` where token i counts in the loss and -100 where it does not. By default only
the completion, or each assistant turn, counts, together with the EOS that ends it (TRL's completion-only loss,
axolotl's ``train_on_inputs: false``); ``train_on_inputs=True`` counts every token. ``labels[0]`` is always -100:
no token predicts the first one. So for a prompt-completion record (with a prompt) the counted tokens are exactly
``encode(completion) + encode(eos_token)``, and for a chat each assistant turn counts its content and the
template's end-of-turn text up to and including the EOS token (what follows, e.g. ChatML's newline, does not).

How the answer's tokens are found: the pieces are rendered as strings and each piece is tokenized on its own,
then concatenated (torchtune tokenizes message by message; TRL tokenizes the prompt on its own). For a chat, the
prefix up to assistant turn k is the template rendered on the first k messages with ``add_generation_prompt``,
which is exactly the string a model sees at inference before it answers; the template must render conversations
prefix by prefix (every template that appends turns does), else the record is refused, named. With a character
tokenizer pieces and the whole string tokenize identically; with BPE a merge across a piece boundary is not made,
as it is not made at inference, where the prompt is tokenized alone. Text and prompt-completion records start with
what the tokenizer itself puts before text (special_prefix: Llama's BOS), uncounted; chat templates write their own.
A template that writes no EOS after an assistant turn still has the turn counted; SFTStats.without_eos says how often.

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


def special_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before plain text by itself (Llama's BOS; [] for GPT-2, Qwen and MiniGPT).

    Text and prompt-completion records start with them, as ``tokenizer(text)`` starts in TRL; chat templates
    write their own BOS.
    """
    try:
        import tokenizers

        if isinstance(tokenizer, tokenizers.Tokenizer):
            with_special = tokenizer.encode("a", add_special_tokens=True).ids
        elif hasattr(tokenizer, "apply_chat_template"):
            with_special = tokenizer.encode("a", add_special_tokens=True)
        else:
            return []
    except ImportError:
        return []
    plain = plain_encoder(tokenizer)("a")
    n = len(with_special) - len(plain)
    return list(with_special[:n]) if n > 0 and with_special[n:n + len(plain)] == plain else []


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> ids without added special tokens, for MiniGPT's CharTokenizer, transformers or `tokenizers`."""
    try:
        import tokenizers

        if isinstance(tokenizer, tokenizers.Tokenizer):
            return lambda s: tokenizer.encode(s, add_special_tokens=False).ids
    except ImportError:
        pass
    if hasattr(tokenizer, "apply_chat_template"):  # a transformers tokenizer
        return lambda s: tokenizer.encode(s, add_special_tokens=False)
    return tokenizer.encode


def chat_pieces(messages: list[dict], template: ChatTemplate, where: str = "") -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_answer) pieces; their concatenation is template.render(messages)."""

    def render(msgs: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return template.render(msgs, add_generation_prompt)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None

    full = render(messages)
    eos = template.eos_token
    pieces, pos = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], add_generation_prompt=True)
        upto = render(messages[: k + 1])
        turn = upto[len(before):]
        cut = turn.rfind(eos)  # the last: an answer may quote the EOS text
        end = len(before) + (cut + len(eos) if cut >= 0 else len(turn))
        if not (upto.startswith(before) and full[:end] == upto[:end] and len(before) >= pos):
            raise InputError(f"{where}: the chat template does not render this conversation prefix by prefix "
                             f"(at message {k}), so its assistant turns cannot be located")
        pieces += [(full[pos:len(before)], False), (full[len(before):end], True)]
        pos = end
    pieces.append((full[pos:], False))
    return [(t, a) for t, a in pieces if t]


def record_pieces(record: Record, template: ChatTemplate) -> list[tuple[str, bool]]:
    """(text, is_answer) pieces of a record: text + EOS; prompt, completion + EOS; or the rendered chat."""
    eos = template.eos_token
    if record.kind == "text":
        return [(record.text, True), (eos, True)]
    if record.kind == "completion":
        return [(record.prompt, False), (record.completion, True), (eos, True)]
    return chat_pieces(list(record.messages), template, record.where)


def record_text(record: Record, template: ChatTemplate) -> str:
    """The whole string a record trains on (for checks such as characters a tokenizer never saw)."""
    return "".join(t for t, _ in record_pieces(record, template))


def tokenize_record(record: Record, encode: Callable[[str], list[int]], template: ChatTemplate,
                    train_on_inputs: bool = False, prefix_ids: Sequence[int] = ()) -> Example:
    """One record as an Example (untruncated); `prefix_ids` (special_prefix) start a text or prompt-completion."""
    pieces = record_pieces(record, template)
    ids: list[int] = [] if record.kind == "chat" else list(prefix_ids)
    labels: list[int] = [IGNORE] * len(ids)
    for text, answer in pieces:
        piece = list(encode(text))
        ids += piece
        labels += piece if (answer or train_on_inputs) else [IGNORE] * len(piece)
    if labels:
        labels[0] = IGNORE  # nothing predicts the first token
    without_eos = record.kind == "chat" and any(a and not t.endswith(template.eos_token) for t, a in pieces)
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
    encode, prefix = plain_encoder(tokenizer), special_prefix(tokenizer)
    limit = block_size + 1
    examples, stats = [], SFTStats()
    for record in records:
        ex = tokenize_record(record, encode, template, cfg.train_on_inputs, prefix)
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

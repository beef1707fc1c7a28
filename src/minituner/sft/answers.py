"""Where the answers of a rendered chat are: character spans that count in the loss (sft.examples tokenizes them).

Three ways, the first that applies:
- a template that wraps answers in ``{% generation %}`` says where they are (transformers'
  ``return_assistant_tokens_mask``, the mask TRL's assistant_only_loss trains on);
- the prefix up to assistant turn k, the template rendered on the first k messages with ``add_generation_prompt``
  (exactly the string a model sees at inference before it answers), starts the answer, and the last end marker
  its turn writes ends it: the EOS or one of the tokenizer's special tokens (``<|eot_id|>``, ``<|im_end|>``,
  ``<end_of_turn>``), so ChatML's newline after ``<|im_end|>`` does not count;
- a template that rewrites earlier turns as the conversation grows (Mistral v0.3's system message, Qwen3's
  thinking) does not render prefix by prefix: a marker after each answer's content places its end, and the
  answer starts after the generation prompt as above.
A conversation none of them locates is refused, named.
"""
from __future__ import annotations

from typing import Callable, Sequence

from minigpt.errors import InputError

from .templates import ChatTemplate

Span = tuple[int, int]  # [start, end) in characters of a rendered record


def _turn_end(turn: str, markers: Sequence[str]) -> int:
    """Where an assistant turn's answer ends: after the last end marker the turn writes (the EOS, or a special
    token such as <|im_end|>), so ChatML's newline after it does not count; the whole turn when there is none."""
    ends = [i + len(m) for m in markers if m and (i := turn.rfind(m)) >= 0]  # the last: an answer may quote one
    return max(ends) if ends else len(turn)


def chat_answers(messages: list[dict], template: ChatTemplate, where: str = "",
                 answers_from: int = 0) -> tuple[str, list[Span]]:
    """The rendered conversation and the span of each assistant answer in it (its content and end of turn), from
    message `answers_from` on (TRL's conversational prompt-completion: the completion's), less those of a turn whose
    "weight" is 0 (axolotl's: a turn not trained on; sft.formats allows 0 and 1).

    A template with {% generation %} blocks says where they are (transformers' assistant mask, what TRL's
    assistant_only_loss trains on). Otherwise the prefix up to assistant turn k is the template rendered on the
    first k messages with add_generation_prompt, the string a model sees at inference before it answers, and the
    answer runs from there to the turn's end (``_turn_end``); a template that does not render conversations prefix
    by prefix has its answers placed by markers (``_answers_by_marker``), or is refused, named."""

    def render(msgs: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return template.render(msgs, add_generation_prompt)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None

    counted = [m.get("weight", 1) != 0 for m in messages[answers_from:] if m["role"] == "assistant"]  # per answer
    if template.marks_answers:
        try:
            full, spans = template.render_answers(messages)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        before = sum(m["role"] == "assistant" for m in messages[:answers_from])  # the prompt's answers
        if len(spans) == sum(m["role"] == "assistant" for m in messages):  # one block per answer
            return full, [(a, b) for (a, b), c in zip(spans[before:], counted) if b > a and c]
        if not before:
            if not all(counted):
                raise InputError(f"{where}: a turn of weight 0, and a chat template whose {{% generation %}} blocks "
                                 "are not one per answer: which answer to leave out cannot be told")
            return full, [(a, b) for a, b in spans if b > a]
    full = render(messages)
    spans, pos = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k < answers_from:
            continue
        before = render(messages[:k], add_generation_prompt=True)
        upto = render(messages[: k + 1])
        end = len(before) + _turn_end(upto[len(before):], template.end_markers)
        if not (upto.startswith(before) and full[:end] == upto[:end] and len(before) >= pos):
            spans = _answers_by_marker(messages, full, render, template.end_markers, where, answers_from)
            return full, [span for span, c in zip(spans, counted) if c]
        spans.append((len(before), end))
        pos = end
    return full, [span for span, c in zip(spans, counted) if c]


ANSWER_MARKER = "MinituneRAnswerMarker7f3a9c"  # marks an answer's content (no space, no template syntax)


def _answers_by_marker(messages: list[dict], full: str, render: Callable[..., str],
                       markers: Sequence[str], where: str, answers_from: int) -> list[Span]:
    """The answers of a template that rewrites earlier turns as a conversation grows (Mistral v0.3 moves the system
    message into the last user turn; Qwen3 drops earlier turns' thinking), so that prefixes do not render alike.
    Each assistant turn is rendered whole with ANSWER_MARKER after its content (where the content ends) and, where
    needed, in place of it (where it starts). An answer starts after the template's generation prompt (the text
    add_generation_prompt appends: a Qwen3 answer's thinking counts) or, for a template without one, where its
    content starts; it ends with its content and the end marker right after it (whitespace between allowed)."""
    spans: list[Span] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k < answers_from:
            continue
        end = _content_end(messages, k, full, render)
        start = None if end is None else _answer_start(messages, k, full, render, end)
        if start is None or end is None or start > end or (spans and start < spans[-1][1]):
            raise InputError(f"{where}: the chat template renders this conversation neither prefix by prefix nor "
                             f"with assistant message {k} in one place, so its answers cannot be located; a "
                             "template that marks answers with {% generation %} can be")
        rest = full[end:]
        found = [(i, len(mk)) for mk in markers if mk and (i := rest.find(mk)) >= 0 and not rest[:i].strip()]
        spans.append((start, end + (sum(min(found)) if found else 0)))
    return spans


def _with_content(messages: list[dict], k: int, content: str) -> list[dict]:
    return [*messages[:k], {**messages[k], "content": content}, *messages[k + 1:]]


def _content_end(messages: list[dict], k: int, full: str, render: Callable[..., str]) -> int | None:
    """Where message k's content ends in `full`: the marker after it must leave the rendering otherwise unchanged;
    else the marker in its place must leave the text after it unchanged."""
    if ANSWER_MARKER in full:
        return None
    probe = render(_with_content(messages, k, messages[k]["content"] + ANSWER_MARKER))
    at = probe.find(ANSWER_MARKER)
    if at >= 0 and probe[:at] + probe[at + len(ANSWER_MARKER):] == full:
        return at
    probe = render(_with_content(messages, k, ANSWER_MARKER))
    at = probe.find(ANSWER_MARKER)
    after = probe[at + len(ANSWER_MARKER):]
    if at < 0 or ANSWER_MARKER in after or full[:at] != probe[:at] or not full.endswith(after):
        return None
    return len(full) - len(after)


def _answer_start(messages: list[dict], k: int, full: str, render: Callable[..., str], end: int) -> int | None:
    """Where answer k starts in `full`: after the last generation prompt before its content's end, or (a template
    without one) where the marker in place of its content lands."""
    try:
        plain, prompted = render(messages[:k]), render(messages[:k], add_generation_prompt=True)
    except InputError:  # a template that refuses a conversation ending in a user turn
        plain = prompted = ""
    prompt = prompted[len(plain):] if prompted.startswith(plain) else ""
    if prompt and (at := full.rfind(prompt, 0, end)) >= 0:
        return at + len(prompt)
    probe = render(_with_content(messages, k, ANSWER_MARKER))
    at = probe.find(ANSWER_MARKER)
    return at if at >= 0 and full[:at] == probe[:at] else None

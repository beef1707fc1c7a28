"""The shapes an instruction or chat record takes, and how a data set splits into train, val and test.

The shapes are the ones TRL's SFTTrainer, axolotl and torchtune agree on:

- ``text``: ``{"text": "..."}``, every token counts;
- ``prompt-completion``: ``{"prompt": "...", "completion": "..."}`` (TRL's "conversational" variant, where both
  are lists of messages, is read as one conversation whose completion's assistant turns alone count, as TRL's
  completion-only loss counts them: an assistant turn inside the prompt is context);
- ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, rendered with a chat template;
- ``alpaca``: ``{"instruction": "...", "input": "..." (optional), "output": "..."}``, read as a conversation of
  one user turn (instruction, then a blank line and the input when there is one) and one assistant turn, after
  LLaMA-Factory's ``history`` ([[instruction, answer], ...]) as earlier turns where there is one;
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...],
  "system": "..." (optional)}``, as FastChat, axolotl and LLaMA-Factory write it, read as ``messages`` with the
  roles of SHAREGPT_ROLES (turns written ``{"role", "content"}`` are read too; a ``system`` field becomes the
  first turn).

A record's ``system`` field opens a chat (every shape but text and plain prompt-completion, where no template
would render it and it is refused) unless the chat opens with that system turn itself; one that says otherwise is
refused. A turn's ``weight`` (axolotl's) is 0 (an answer left out of the loss) or 1; tool calls are refused.

The shape is recognised per file from the fields of its first record (or forced with ``fmt``); every record of
the file must then fit it. Other fields of a record are ignored. Mistakes name the file and the line
(``files`` reads them).
"""
from __future__ import annotations

from dataclasses import dataclass

from minigpt.errors import InputError

FORMATS = ("text", "prompt-completion", "messages", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
SPLITS = ("train", "val", "test")
# ShareGPT's speaker names (FastChat, axolotl's defaults, LLaMA-Factory's tags) -> chat template roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "tool": "tool", "observation": "tool", "function_response": "tool"}


@dataclass(frozen=True)
class Record:
    """One example as read: exactly one of `text`, (`prompt`, `completion`) or `messages` is set."""

    format: str  # the shape it was read as (one of FORMATS)
    where: str  # "file:line", for messages that name it
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict, ...] | None = None  # each {"role": str, "content": str, ...any other fields}
    answers_from: int = 0  # a chat's assistant turns count from this message on (the completion's, after a prompt)
    split: str | None = None  # the split (one of SPLITS) its file's name gives, as Hugging Face datasets names them

    @property
    def kind(self) -> str:
        """How it is tokenized: "text", "completion" (prompt + completion) or "chat" (a template renders it)."""
        return "text" if self.text is not None else "completion" if self.prompt is not None else "chat"


def detect_format(obj: dict) -> str | None:
    """The shape a record's fields fit, or None; `messages` wins over `conversations` (sharegpt), then
    `prompt`/`completion`, then alpaca, then text. Fields that are null count only when nothing else fits (a
    Parquet file's columns are the union of its records' fields, the missing ones null)."""
    present = {k: v for k, v in obj.items() if v is not None}
    return _shape_of(present) or _shape_of(obj)


def _shape_of(obj: dict) -> str | None:
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "prompt" in obj and "completion" in obj:
        return "prompt-completion"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "text" in obj:
        return "text"
    return None


def _fields(obj: dict) -> str:
    return ", ".join(sorted(map(str, obj))) or "none"


def _string(obj: dict, key: str, where: str, *, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _messages(value, where: str, key: str = "messages") -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and m.get("tool_calls") and m.get("role") == "assistant":
            raise InputError(f"{where}: {key}[{i}] is an assistant's tool call ('tool_calls'): tool-calling turns "
                             "are not supported (their answers cannot be located in the rendered chat)")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content' "
                             f"({_found(m, ('role', 'content'))})")
        if m["role"] not in ROLES:
            raise InputError(f"{where}: {key}[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise InputError(f"{where}: {key}[{i}] is an empty assistant message")
        _check_weight(m, f"{where}: {key}[{i}]")
        out.append({k: v for k, v in m.items() if v is not None})  # other fields (name, ...) reach the template
    return tuple(out)


def _found(value, keys: tuple[str, ...]) -> str:
    """What a turn holds instead of string `keys`: the type of a key's value that is no string, else its fields."""
    if not isinstance(value, dict):
        return f"found a {type(value).__name__}"
    wrong = [f"{k!r} is {'null' if value[k] is None else 'a ' + type(value[k]).__name__}" for k in keys
             if k in value and not isinstance(value[k], str)]
    return ", ".join(wrong) if wrong else f"found {_fields(value)}"


WEIGHTS = (0, 1)  # a turn's "weight" (axolotl's): 0 leaves an answer out of the loss, 1 counts it


def _check_weight(turn: dict, where: str) -> None:
    """InputError for a turn's weight other than 0 or 1 (no loss is weighted here), or 1 on a turn that is not an
    answer (--train-on-inputs counts every turn)."""
    weight = turn.get("weight")
    if weight is None:
        return
    if isinstance(weight, bool) or weight not in WEIGHTS:
        raise InputError(f"{where}: weight {weight!r}; a turn's weight is 0 (its answer left out of the loss) or 1")
    if weight == 1 and turn.get("role") != "assistant":
        raise InputError(f"{where}: weight 1 on a {turn.get('role')} turn: only answers count (--train-on-inputs "
                         "counts every turn)")


def _system_field(obj: dict, where: str) -> str:
    """A record's `system` field ("" where there is none); InputError for one that is no string."""
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise InputError(f"{where}: field 'system' must be a string, got {type(system).__name__}")
    return system or ""


def _with_system(messages: tuple[dict, ...], system: str, where: str) -> tuple[dict, ...]:
    """A record's `system` field as the conversation's first turn; InputError where the conversation opens with a
    system turn of its own that says something else."""
    if not system:
        return messages
    if messages and messages[0]["role"] == "system":
        if messages[0]["content"] != system:
            raise InputError(f"{where}: a 'system' field and a first system turn that differ: keep one")
        return messages
    return ({"role": "system", "content": system}, *messages)


def _sharegpt(obj: dict, where: str) -> tuple[dict, ...]:
    """ShareGPT's turns as messages: `from`/`value` (or `role`/`content`), speakers mapped by SHAREGPT_ROLES."""
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    messages = []
    for i, t in enumerate(turns):
        keys = ("from", "value") if isinstance(t, dict) and t.get("from") is not None else ("role", "content")
        if not isinstance(t, dict) or not isinstance(t.get(keys[0]), str) or not isinstance(t.get(keys[1]), str):
            raise InputError(f"{where}: conversations[{i}] must be an object with string 'from' and 'value' "
                             f"({_found(t, keys)})")
        role = SHAREGPT_ROLES.get(t[keys[0]].lower())
        if role is None:
            raise InputError(f"{where}: conversations[{i}] is from {t[keys[0]]!r}; speakers are "
                             f"{', '.join(SHAREGPT_ROLES)}")
        extra = {k: v for k, v in t.items() if k not in keys}  # other fields (name, ...) reach the template
        messages.append({**extra, "role": role, "content": t[keys[1]]})
    system = _system_field(obj, where)
    return _with_system(_messages(messages, where, "conversations"), system, where)  # indices as in the file


def _conversation(messages: tuple[dict, ...], fmt: str, where: str, answers_from: int = 0) -> Record:
    prompt_answer = next((i for i, m in enumerate(messages[:answers_from]) if m.get("weight") == 1), None)
    if prompt_answer is not None:  # a prompt's turns are context (TRL's conversational prompt-completion)
        raise InputError(f"{where}: weight 1 on prompt turn {prompt_answer}: only the completion's answers count")
    answers = [m for m in messages[answers_from:] if m["role"] == "assistant"]
    part = "the completion" if answers_from else "the conversation"
    if not answers:
        raise InputError(f"{where}: {part} has no assistant turn (nothing to learn from)")
    if all(m.get("weight") == 0 for m in answers):
        raise InputError(f"{where}: every assistant turn of {part} has weight 0 (nothing to learn from)")
    return Record(fmt, where, messages=messages, answers_from=answers_from)


def parse_record(obj, fmt: str, where: str) -> Record:
    """Check one JSON value against a shape and return it as a Record; InputError names `where` and the fields."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if fmt == "messages" and obj.get("messages") is not None:
        return _conversation(_with_system(_messages(obj["messages"], where), _system_field(obj, where), where), fmt,
                             where)
    if fmt == "sharegpt" and obj.get("conversations") is not None:
        return _conversation(_sharegpt(obj, where), fmt, where)
    if fmt == "prompt-completion" and "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, list) != isinstance(completion, list):
            raise InputError(f"{where}: 'prompt' and 'completion' must both be strings, or both lists of "
                             f"{{role, content}} messages (got a {type(prompt).__name__} and a "
                             f"{type(completion).__name__})")
        if isinstance(prompt, list):  # TRL's conversational prompt-completion
            prompt_messages = _with_system(_messages(prompt, where, "prompt"), _system_field(obj, where), where)
            messages = prompt_messages + _messages(completion, where, "completion")
            return _conversation(messages, fmt, where, answers_from=len(prompt_messages))
        _no_system(obj, fmt, where)
        prompt, completion = _string(obj, "prompt", where), _string(obj, "completion", where)
        if not completion.strip():
            raise InputError(f"{where}: empty completion (nothing to learn from)")
        return Record(fmt, where, prompt=prompt, completion=completion)
    if fmt == "alpaca" and "instruction" in obj and "output" in obj:
        instruction, extra = _string(obj, "instruction", where), _string(obj, "input", where, required=False)
        output = _string(obj, "output", where)
        if not output.strip():
            raise InputError(f"{where}: empty output (nothing to learn from)")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = (*_alpaca_history(obj, where), {"role": "user", "content": user},
                    {"role": "assistant", "content": output})
        return Record(fmt, where, messages=_with_system(messages, _system_field(obj, where), where))
    if fmt == "text" and "text" in obj:
        _no_system(obj, fmt, where)
        text = _string(obj, "text", where)
        if not text.strip():
            raise InputError(f"{where}: empty text")
        return Record(fmt, where, text=text)
    found = detect_format(obj)
    why = f"it looks like {found}" if found else f"it fits none of {', '.join(FORMATS)}"
    raise InputError(f"{where}: fields found: {_fields(obj)}; expected {fmt} ({why})")


def _alpaca_history(obj: dict, where: str) -> tuple[dict, ...]:
    """LLaMA-Factory's alpaca `history`, [[instruction, answer], ...] before the record's own, as earlier turns
    (their answers count, as LLaMA-Factory trains them by default)."""
    history = obj.get("history")
    if history is None:
        return ()
    if not isinstance(history, list) or not all(isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(x, str) for x in pair) for pair in history):
        raise InputError(f"{where}: field 'history' must be a list of [instruction, answer] pairs of strings")
    turns = [{"role": role, "content": text} for pair in history for role, text in zip(("user", "assistant"), pair)]
    return _messages(turns, where, "history")


def _no_system(obj: dict, fmt: str, where: str) -> None:
    """InputError for a non-empty `system` field in a record no chat template renders (text, plain
    prompt-completion): it would be dropped without a word."""
    if _system_field(obj, where).strip():
        raise InputError(f"{where}: a 'system' field in a {fmt} record, which no chat template renders: write the "
                         "records as messages (or alpaca) to use it, or leave the field out")


# the fields the shapes read, which --columns may take from a data set's own columns
FIELDS = ("text", "prompt", "completion", "messages", "conversations", "instruction", "input", "output", "system",
          "history")
Columns = tuple[tuple[str, str], ...]  # (the field a shape reads, the data set's column it comes from)
SplitNames = tuple[tuple[str, str], ...]  # (train, val or test; the data set's own name for that split)


@dataclass(frozen=True)
class DataSelection:
    """Which records of a data set to read, under which names: --data-config, --data-split and --columns."""

    config: str | None = None  # a dataset card's config (subset); None: the one datasets reads unnamed
    splits: SplitNames = ()  # the data set's splits to read as ours (train=train_sft); (): read by their names
    columns: Columns = ()  # (field a shape reads, the data set's column) renames

    def flags(self) -> list[str]:
        """The flags that set it, as a user gave them."""
        return [flag for flag, given in (("--data-config", self.config), ("--data-split", self.splits),
                                         ("--columns", self.columns)) if given]


def parse_pairs(spec: str, flag: str, example: str) -> tuple[tuple[str, str], ...]:
    """A flag's "A=B,C=D" as given -> (("A", "B"), ("C", "D")); `example` shows the form in the error."""
    pairs = []
    for part in spec.split(","):
        left, sep, right = (x.strip() for x in part.partition("="))
        if not sep or not left or not right:
            raise InputError(f"{flag} {spec!r}: each item is {example}")
        pairs.append((left, right))
    return tuple(pairs)


def parse_data_splits(spec: str) -> SplitNames:
    """``--data-split`` as given: "train=train_sft,val=test_sft" -> (("train", "train_sft"), ("val", "test_sft"))."""
    return check_data_splits(parse_pairs(spec, "--data-split", "SPLIT=NAME, e.g. train=train_sft,val=test_sft"), spec)


def check_data_splits(splits: SplitNames, spec: str | None = None) -> SplitNames:
    """(split, name) pairs whose splits are ours (train, val, test), each given once, naming distinct splits."""
    given = spec if spec is not None else ",".join(f"{a}={b}" for a, b in splits)
    for ours, _ in splits:
        if ours not in SPLITS:
            raise InputError(f"--data-split {given!r}: {ours!r} is not one of {', '.join(SPLITS)}")
    if len({a for a, _ in splits}) < len(splits) or len({b for _, b in splits}) < len(splits):
        raise InputError(f"--data-split {given!r} names a split twice")
    return splits


def parse_columns(spec: str) -> Columns:
    """``--columns`` as given: "prompt=question,completion=answer" -> (("prompt", "question"), ...)."""
    return check_columns(parse_pairs(spec, "--columns", "FIELD=COLUMN, e.g. prompt=question,completion=answer"), spec)


def check_columns(columns: Columns, spec: str | None = None) -> Columns:
    """(field, column) pairs whose fields are ones the shapes read, each named once."""
    for name, _ in columns:
        if name not in FIELDS:
            raise InputError(f"--columns: {name!r} is not a field the shapes read ({', '.join(FIELDS)})")
    names = [n for n, _ in columns]
    if len(set(names)) < len(names):
        given = spec if spec is not None else ",".join(f"{n}={c}" for n, c in columns)
        raise InputError(f"--columns {given!r} names a field twice")
    return columns


def renamed(obj, columns: Columns, where: str):
    """A record with the data set's columns renamed to the fields the shapes read (--columns); a record without
    one of the columns is refused, named."""
    if not columns or not isinstance(obj, dict):
        return obj
    missing = [column for _, column in columns if column not in obj]
    if missing:
        raise InputError(f"{where}: no column {missing[0]!r} (--columns {','.join(f'{n}={c}' for n, c in columns)}; "
                         f"fields found: {_fields(obj)})")
    taken = {column for _, column in columns}
    return {**{k: v for k, v in obj.items() if k not in taken}, **{name: obj[column] for name, column in columns}}


def check_format(fmt: str | None) -> None:
    """None (recognise per file) or one of FORMATS."""
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"unknown data format {fmt!r}; valid: {', '.join(FORMATS)}")


def first_format(obj, where: str) -> str:
    """The shape a file's first record fits, which every record of the file must then fit."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fmt = detect_format(obj)
    if fmt is None:
        raise InputError(f"{where}: fields found: {_fields(obj)}; a record needs 'text', 'prompt' and "
                         "'completion', 'messages', 'conversations', or 'instruction' and 'output'")
    return fmt


def _carved(records: list[Record], period: int, with_test: bool = True) -> dict[str, list[Record]]:
    """Deterministic split as minigpt.data.split_documents: of every `period` records one goes to val, one to test
    (to train when `with_test` is False). With fewer than `period` records there is no test split and one record
    in five (at least one) is val."""
    if len(records) < 2:
        raise InputError(f"{len(records)} record(s): at least 2 are needed for a train and a val split")
    if len(records) < period:
        period = min(5, len(records))
        val = set(range(period - 1, len(records), period))
        return {"train": [r for i, r in enumerate(records) if i not in val],
                "val": [r for i, r in enumerate(records) if i in val], "test": []}
    parts: dict[str, list[Record]] = {"train": [], "val": [], "test": []}
    for i, r in enumerate(records):
        k = i % period
        parts["val" if k == period - 2 else "test" if k == period - 1 and with_test else "train"].append(r)
    return parts


def split_records(records: list[Record], period: int = 20) -> dict[str, list[Record]]:
    """Train, val and test records.

    Records whose files name their split (``Record.split``, as Hugging Face datasets names them) keep it; a val
    split the files do not give is carved out of train (one record in `period`), and so is a test split. Records
    without one are carved whole: of every `period` one goes to val and one to test. A data set whose files name
    no train split gets an empty one (evaluation can still read its other splits)."""
    if all(r.split is None for r in records):
        return _carved(records, period)
    named = {s: [r for r in records if r.split == s] for s in SPLITS}
    if named["train"] and not named["val"]:
        carved = _carved(named["train"], period, with_test=not named["test"])
        return {**carved, "test": named["test"] or carved["test"]}
    return named

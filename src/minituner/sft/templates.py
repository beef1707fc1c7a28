"""Chat templates: read a base folder's Jinja template and render it as transformers' ``apply_chat_template`` does.

The environment matches transformers' (``utils/chat_template_utils.py``): an immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}`` tag (rendered
as its body; ``ChatTemplate.render_answers`` returns where each such block landed in the text, the spans
transformers' ``return_assistant_tokens_mask`` marks), a ``tojson`` filter that does not escape
HTML and keeps non-ASCII (``json.dumps(ensure_ascii=False)``), and the globals ``raise_exception`` and
``strftime_now``. The template sees ``messages`` (keys holding None dropped, reasoning under all its names, as
transformers 5 passes them), ``add_generation_prompt``, ``tools`` and ``documents`` (None), and the tokenizer's
special tokens (``bos_token``, ``eos_token``, ...) as strings, like ``tokenizer.special_tokens_map``: from
``tokenizer_config.json``, with ``special_tokens_map.json`` (older folders keep them there) taking precedence as in
transformers. Not copied:
transformers' stricter ``namespace``/``dict`` globals, which only make some unsafe templates fail. Where the
template comes from follows transformers too: ``chat_template.jinja`` wins over ``chat_template`` in
``tokenizer_config.json``, which may be a string or a list of ``{"name", "template"}`` (``default`` is used).

Bases without a template (MiniGPT, GPT-2) get DEFAULT_TEMPLATE, plain text MiniGPT's character tokenizer
encodes (every character occurs in the Python docs)::

    System: {system}\n                  (when there is a system message)
    User: {question}\n
    Assistant: {answer}{eos_token}      (turns separated by one newline, nothing after the last)

A tokenizer without an EOS token (MiniGPT's characters) ends answers with DEFAULT_EOS, the text ``<|end|>``
(7 characters, hence 7 tokens); generation stops when the model writes it. The headers are short ("User: ", not
"### User:\n") because MiniGPT sees 128 tokens: a forecast-qa record with its bulletin and question fits in 124.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from minigpt.errors import InputError
from minigpt.io import atomic_write_text, write_json

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"
DEFAULT_EOS = "<|end|>"
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' if messages else '' }}Assistant: {% endif %}"
)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class _Answers:
    """While a template renders: the text yielded so far and the (start, end) of each {% generation %} block."""
    blocks: list[str] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag), rendered as its body; while
    ``render_template`` tracks answers, each body's span in the output is recorded (as transformers'
    AssistantTracker does: the text yielded before the block is all that precedes it)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(answers=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            text = caller()
            answers = self.environment.answers
            if answers is not None:
                start = sum(len(b) for b in answers.blocks)
                answers.spans.append((start, start + len(text)))
            return text

    return Generation


@lru_cache(maxsize=32)
def compile_template(source: str):
    """A jinja2 Template built in transformers' environment (cached by source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"the chat template does not parse (line {e.lineno}: {_one_line(e.message)})") from None


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one message's reasoning, under its names


def template_message(message: dict) -> dict:
    """A message as transformers hands it to a template: keys whose value is None dropped, reasoning under each name."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def render_template(source: str, messages: list[dict], add_generation_prompt: bool = False,
                    answers: _Answers | None = None, **variables) -> str:
    """Render a Jinja chat template; `variables` are the special tokens and any extra template arguments. With
    `answers`, the spans of its {% generation %} blocks are recorded there."""
    import jinja2

    template = compile_template(source)
    context = {"tools": None, "documents": None, **variables}  # transformers always passes both
    messages = [template_message(m) for m in messages]
    try:
        if answers is None:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        template.environment.answers = answers
        try:
            for block in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **context):
                answers.blocks.append(block)
        finally:
            template.environment.answers = None
        return "".join(answers.blocks)
    except jinja2.TemplateError as e:
        raise InputError(f"the chat template refused the conversation: {_one_line(e)}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        # a template's own mistake ({{ 1/0 }}, {{ "a" + 1 }}, a macro calling itself): the template is at fault
        raise InputError(f"the chat template fails on this conversation: {type(e).__name__}: "
                         f"{_one_line(e)[:200]}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config stores it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object")
    return d


def _eos_from_model_configs(folder: Path) -> str | None:
    """generation_config.json's eos_token_id, else config.json's (the first, if a list), named through
    tokenizer.json: its added tokens, else its model's vocabulary (a word-level or BPE dict, a Unigram list)."""
    tok = folder / HF_TOKENIZER
    if not tok.is_file():
        return None
    ids = None
    for name in (GENERATION_CONFIG, MODEL_CONFIG):
        if (folder / name).is_file() and (ids := _read_json(folder / name).get("eos_token_id")) is not None:
            break
    if ids is None:
        return None
    ids = ids if isinstance(ids, list) else [ids]
    tokenizer = _read_json(tok)
    names = {t.get("id"): t.get("content") for t in tokenizer.get("added_tokens", []) if isinstance(t, dict)}
    vocab = tokenizer.get("model", {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
    for i in ids:
        if isinstance(names.get(i), str):
            return names[i]
        if isinstance(vocab, dict):
            found = next((w for w, j in vocab.items() if j == i), None)
        elif isinstance(vocab, list) and isinstance(i, int) and 0 <= i < len(vocab) and isinstance(vocab[i], list):
            found = vocab[i][0]
        else:
            found = None
        if isinstance(found, str):
            return found
    return None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template, the special tokens it is rendered with, and where it came from."""

    source: str  # the Jinja text
    special_tokens: dict = field(default_factory=lambda: {"eos_token": DEFAULT_EOS})  # bos_token, eos_token, ...
    origin: str = "default"  # a file path, or "default" for DEFAULT_TEMPLATE
    special_texts: tuple[str, ...] = ()  # the tokenizer's special added tokens (<|im_end|>, <end_of_turn>, ...)
    # the special tokens the tokenizer's files do not name (an eos from config.json, or DEFAULT_EOS): transformers
    # would render them empty, so a saved template sets them itself
    pinned: tuple[str, ...] = ()

    @property
    def eos_token(self) -> str:
        """The text that ends a completion or an assistant turn."""
        return self.special_tokens.get("eos_token") or DEFAULT_EOS

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def end_markers(self) -> tuple[str, ...]:
        """Texts that can end an assistant turn: the EOS and the tokenizer's special tokens (a template's
        end-of-turn token, <|im_end|> or <end_of_turn>, need not be the EOS)."""
        return tuple(dict.fromkeys((self.eos_token, *self.special_texts)))

    @property
    def marks_answers(self) -> bool:
        """Whether the template wraps answers in {% generation %} blocks (render_answers then finds them)."""
        return bool(GENERATION_TAG.search(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
        """The string transformers' apply_chat_template(messages, tokenize=False, ...) returns."""
        return render_template(self.source, messages, add_generation_prompt, **{**self.special_tokens, **variables})

    def saved_source(self) -> str:
        """The text a folder's chat_template.jinja holds so that transformers renders as this template does: the
        source, after a {% set %} of each special token the tokenizer's files do not name (`pinned`)."""
        return "".join(f"{{% set {name} = {json.dumps(self.special_tokens[name], ensure_ascii=False)} %}}"
                       for name in sorted(self.pinned)) + self.source

    def render_answers(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the (start, end) of each {% generation %} block in it."""
        answers = _Answers()
        text = render_template(self.source, messages, False, answers, **self.special_tokens)
        return text, answers.spans


def save_chat_template(folder: str | Path, template: ChatTemplate) -> None:
    """Write `template` as the folder's chat template: chat_template.jinja (what transformers 5 reads first) and,
    where the folder has a tokenizer_config.json, its chat_template (what older transformers read)."""
    folder = Path(folder)
    text = template.saved_source()
    atomic_write_text(folder / TEMPLATE_FILE, text)
    config_path = folder / TOKENIZER_CONFIG
    if config_path.is_file():
        config = _read_json(config_path)
        named = config.get("chat_template")
        if isinstance(named, list):  # named templates (default, tool_use, ...): the default one is replaced
            text = [{**t, "template": text} if isinstance(t, dict) and t.get("name") == "default" else t
                    for t in named]
        write_json(config_path, {**config, "chat_template": text})


def trained_template(adapter: str | Path | None) -> Path | None:
    """The chat template a finetune run trained with: the chat_template.jinja of a run folder, or of the run an
    adapter file or its adapter_peft/ folder lies in (beside the run's manifest.json); else None."""
    if adapter is None:
        return None
    adapter = Path(adapter)
    for run in ([adapter] if adapter.is_dir() else []) + [adapter.parent]:
        if run != adapter and not (run / "manifest.json").is_file():
            continue
        found = run / TEMPLATE_FILE
        if found.exists() and not found.is_file():  # (not the run's template dropped without a word)
            raise InputError(f"{found}: the run's chat template is not a file")
        if found.is_file():
            return found
    return None


def default_template(eos_token: str | None = None, bos_token: str | None = None) -> ChatTemplate:
    tokens = {"eos_token": eos_token or DEFAULT_EOS}
    if bos_token:
        tokens["bos_token"] = bos_token
    return ChatTemplate(DEFAULT_TEMPLATE, tokens, "default")


def _pick(value, path: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise InputError(f"{path}: chat_template is a list without a template named 'default' "
                         f"(names: {', '.join(sorted(map(str, named)))})")
    raise InputError(f"{path}: chat_template must be a string or a list of {{name, template}}")


def _named_tokens(path: Path) -> dict[str, str]:
    """The ``*_token`` entries of tokenizer_config.json or special_tokens_map.json, as strings."""
    config = _read_json(path) if path.is_file() else {}
    return {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}


def _special_added_tokens(folder: Path) -> tuple[str, ...]:
    """The texts of tokenizer.json's added tokens marked special."""
    path = folder / HF_TOKENIZER
    if not path.is_file():
        return ()
    added = _read_json(path).get("added_tokens", [])
    return tuple(t["content"] for t in added if isinstance(t, dict) and t.get("special")
                 and isinstance(t.get("content"), str) and t["content"])


def load_chat_template(folder: str | Path, template_file: str | Path | None = None) -> ChatTemplate:
    """The base folder's chat template and special tokens; DEFAULT_TEMPLATE when it has none (MiniGPT).

    `template_file` (a Jinja file: finetune's --chat-template, or a run's chat_template.jinja) replaces the
    folder's template; the special tokens stay the folder's."""
    folder = Path(folder)
    config_path = folder / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    named = {**_named_tokens(config_path), **_named_tokens(folder / SPECIAL_TOKENS_MAP)}  # what transformers passes
    tokens = dict(named)
    if "eos_token" not in tokens and (eos := _eos_from_model_configs(folder)):
        tokens["eos_token"] = eos
    specials = _special_added_tokens(folder)
    jinja_path = Path(template_file) if template_file is not None else folder / TEMPLATE_FILE
    if template_file is not None and not jinja_path.is_file():
        raise InputError(f"{jinja_path}: " + ("a folder, not a chat template file" if jinja_path.is_dir()
                                              else "not a regular file (a device or pipe), not a chat template file"
                                              if jinja_path.exists() else "chat template file not found"))
    if jinja_path.is_file():
        try:
            source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except UnicodeDecodeError as e:
            raise InputError(f"{jinja_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise InputError(f"{jinja_path}: cannot be read ({e.strerror})") from None
    elif config.get("chat_template") is not None:
        source, origin = _pick(config["chat_template"], config_path), str(config_path)
    else:
        template = default_template(tokens.get("eos_token"), tokens.get("bos_token"))
        source, origin, tokens = template.source, template.origin, template.special_tokens
    if not config_path.is_file() and not (folder / SPECIAL_TOKENS_MAP).is_file():
        # no tokenizer metadata and no EOS id (MiniGPT's characters): answers end as the default template ends
        # them, in the rendering too; transformers would render it empty, so a saved template sets it (`pinned`)
        tokens.setdefault("eos_token", DEFAULT_EOS)
    try:
        compile_template(source)  # a template that does not parse is refused when the folder is read
    except InputError as e:
        raise InputError(f"{origin}: {e}") from None
    return ChatTemplate(source, tokens, origin, specials, tuple(k for k in tokens if named.get(k) != tokens[k]))

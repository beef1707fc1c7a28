"""The tokenizer beside a base model: minigpt's CharTokenizer or a Hugging Face ``tokenizer.json``.

    tok, reason = load_tokenizer("models/llama", vocab_size=32000)   # (None, reason) when there is none

One reader for both formats; ``HFTokenizer`` puts the ``tokenizers`` package behind CharTokenizer's API,
with ``eos_ids`` (end-of-sequence ids, set by the loader from generation_config.json / config.json).
``char_tokenizer_as_hf`` writes a CharTokenizer as a Hugging Face ``tokenizer.json`` encoding every text to the
same ids (an exported MiniGPT's tokenizer, for transformers' ``AutoTokenizer``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from minigpt.base_folder import TOKENIZER
from minigpt.errors import InputError
from minigpt.io import atomic_write_text, read_json
from minigpt.tokenizer import FORMAT, CharTokenizer


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def unseen_characters(self, text: str) -> list[str]: ...

    def save(self, path: str | Path) -> None: ...


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package, behind CharTokenizer's API."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # optional: only for HF tokenizer files

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for a bad file
            raise InputError(f"{path}: not a readable Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids, default=-1) + 1  # the ids it can produce: a sparse vocabulary's largest counts
        self.eos_ids: list[int] = []  # end-of-sequence ids (set by the loader from generation_config/config)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` it reads with (offsets, the ids it puts around text by itself)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def unseen_characters(self, text: str) -> list[str]:
        """The pieces of `text` that encode to the unknown token, each once (none for byte-level BPE or
        SentencePiece with byte fallback; whole words for a word-level vocabulary)."""
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        enc = self._tok.encode(text, add_special_tokens=False)
        return sorted({text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk_id and b > a})

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), self._tok.to_str())


def char_tokenizer_as_hf(tok: CharTokenizer) -> str:
    """The text of a Hugging Face tokenizer.json that encodes and decodes as `tok`: a word-level vocabulary of
    its characters (id 0 ``<unk>`` for any other), every character split into its own piece, pieces joined
    back without separators."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tokenizer

    hf = _Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(tok.itos)}, unk_token=tok.itos[0]))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    hf.decoder = decoders.Fuse()  # "a", "b" -> "ab" (a word-level decode would put spaces between them)
    return hf.to_str()


def load_tokenizer(folder: str | Path, vocab_size: int) -> tuple[Tokenizer | None, str]:
    """The tokenizer beside a model, or None and the reason in words; an id at or past `vocab_size` is an InputError."""
    path = Path(folder) / TOKENIZER
    if not path.is_file():
        if (Path(folder) / "vocab.json").is_file():
            return None, f"{folder}: has vocab.json but no {TOKENIZER} (save it with a fast tokenizer)"
        return None, f"{folder}: no {TOKENIZER} beside the model"
    d = read_json(path)
    if d.get("format") == FORMAT:
        tok: Tokenizer = CharTokenizer.load(path)
    elif "model" in d:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            return None, f"{path} is a Hugging Face tokenizer and the `tokenizers` package is not installed"
        tok = HFTokenizer(path)
    else:
        raise InputError(f"{path}: neither a {FORMAT} nor a Hugging Face tokenizer")
    if tok.vocab_size > vocab_size:
        raise InputError(f"{path}: tokenizer has ids up to {tok.vocab_size - 1} but the model only {vocab_size} "
                         "embedding rows")
    return tok, ""

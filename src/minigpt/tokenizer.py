"""A character-level tokenizer stored as ``tokenizer.json``.

Why characters: MiniGPT has d_model 64, so a byte-level BPE vocabulary of thousands of tokens would
put most parameters in the embedding and swamp the LoRA arithmetic the labs are about. A character
vocabulary (~100 symbols for the Python docs) keeps the embedding at ~6.6k parameters, is exactly
reversible, and needs no training beyond counting characters. Id 0 is ``<unk>``: a character never
seen when the vocabulary was built encodes to it instead of raising.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError
from .io import atomic_write_text

UNK = "<unk>"
FORMAT = "minigpt-char-v1"


class CharTokenizer:
    def __init__(self, chars: list[str]) -> None:
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise InputError("tokenizer vocabulary must be distinct single characters")
        self.itos = [UNK] + list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos) if i > 0}

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        """Deterministic: the sorted set of characters in text."""
        if not text:
            raise InputError("cannot build a tokenizer from empty text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, 0) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] if 0 < int(i) < len(self.itos) else "\ufffd" for i in ids)

    def unseen_characters(self, text: str) -> list[str]:
        """The distinct characters of text that the vocabulary does not hold, sorted."""
        return sorted(set(text) - set(self.stoi))

    def unknown_count(self, text: str) -> int:
        """How many characters of text the vocabulary does not hold."""
        return sum(1 for c in text if c not in self.stoi)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "unk_token": UNK, "vocab_size": self.vocab_size, "vocab": self.itos}

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), ensure_ascii=False, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            if d.get("format") != FORMAT or d["vocab"][0] != UNK:
                raise ValueError("unknown format")
            tok = cls(d["vocab"][1:])
        except FileNotFoundError:
            raise InputError(f"{path}: tokenizer file not found") from None
        except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: not a {FORMAT} tokenizer ({e})") from None
        if d.get("vocab_size", tok.vocab_size) != tok.vocab_size:
            raise InputError(f"{path}: vocab_size {d['vocab_size']} disagrees with its vocab ({tok.vocab_size})")
        return tok


def read_vocab_size(path: str | Path) -> int:
    """vocab_size as recorded in a tokenizer.json (what Lab 01 reads)."""
    return CharTokenizer.load(path).vocab_size

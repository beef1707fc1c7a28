"""Load any base model minituner can fine-tune, chosen by ``model_type`` in the folder's config.json.

    model, tokenizer = load_base("artifacts/base")   # a MiniGPT folder, or a Hugging Face GPT-2 folder
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from minigpt.base_folder import CONFIG, TOKENIZER, WEIGHTS, WEIGHTS_INDEX, load_minigpt_folder
from minigpt.errors import InputError
from minigpt.io import atomic_write_text, read_json
from minigpt.model import MiniGPT
from minigpt.tokenizer import FORMAT, CharTokenizer

from .hf_gpt2 import load_gpt2

KINDS = {
    "minigpt": "a minituner base folder (written by `minituner pretrain`)",
    "gpt2": "a Hugging Face GPT-2 folder (config.json + model.safetensors)",
}


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
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_ids: list[int] = []  # end-of-sequence ids (set by the loader from generation_config/config)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def unseen_characters(self, text: str) -> list[str]:
        """Characters that encode to the model's unknown token (none for byte-level BPE such as GPT-2's)."""
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        return sorted(c for c in set(text) if unk_id in self.encode(c))

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), self._tok.to_str())


def load_tokenizer(folder: str | Path, vocab_size: int) -> tuple[Tokenizer | None, str]:
    """The tokenizer beside a GPT-2 model, or None and the reason in words."""
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
        raise InputError(f"{path}: tokenizer has {tok.vocab_size} tokens but the model only {vocab_size}")
    return tok, ""


def load_base(folder: str | Path, device: str | torch.device = "cpu") -> tuple[MiniGPT, Tokenizer | None]:
    """A minituner base folder or a Hugging Face GPT-2 folder -> (MiniGPT in eval mode, tokenizer or None)."""
    folder = Path(folder)
    valid = "; ".join(f"{k}: {v}" for k, v in KINDS.items())
    if not folder.is_dir():
        raise InputError(f"{folder}: no such model folder (valid: {valid})")
    if not (folder / CONFIG).is_file():
        raise InputError(f"{folder}: not a model folder, no {CONFIG} (valid: {valid})")
    kind = read_json(folder / CONFIG).get("model_type", "minigpt")
    if kind == "minigpt":
        return load_minigpt_folder(folder, device)
    if kind == "gpt2":
        model = load_gpt2(folder, device)
        tokenizer, _ = load_tokenizer(folder, model.config.vocab_size)
        return model, tokenizer
    raise InputError(f"{folder}/{CONFIG}: model_type {kind!r} is not supported; valid model_type values: {valid}")


def base_weights_file(folder: str | Path) -> Path:
    """The file whose sha256 identifies a base: model.safetensors, or the index of a sharded checkpoint."""
    folder = Path(folder)
    single = folder / WEIGHTS
    return single if single.is_file() else folder / WEIGHTS_INDEX

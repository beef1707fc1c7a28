"""Built-in shapes for the models Theory 02 names, and MiniGPT's vocabulary size.

MiniGPT's vocab_size is whatever its tokenizer holds: read from a ``tokenizer.json`` when there is
one, otherwise rebuilt exactly as ``minituner pretrain`` builds it (the sorted characters of the
train split of ``builtin:python-docs``), so a fresh clone gets the same number without pretraining.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.data import PRETRAIN_DATA, load_documents, split_documents
from minigpt.errors import InputError
from minigpt.model import GPTConfig
from minigpt.tokenizer import CharTokenizer, read_vocab_size

from ..hf_config import decoder_config_from_hf
from .hf import shape_from_config
from .shapes import ModelShape, minigpt_shape

DEFAULT_TOKENIZER = Path("artifacts/base/tokenizer.json")

# Meta's LLaMA-7B and Llama-2-70B as Hugging Face configs (SwiGLU, RMSNorm, untied head; 70B uses GQA).
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "tie_word_embeddings": False}
LLAMA_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
# MiniGPT sizes: the Lab's d 64 / L 4 and Theory 02's GPT-2-small-sized d 768 / L 12, both on MiniGPT's vocabulary.
MINIGPT_SIZES = {"minigpt": {}, "minigpt-768": {"d_model": 768, "n_layer": 12, "n_head": 12}}
LLAMA_CONFIGS = {"llama-7b": LLAMA_7B, "llama-70b": LLAMA_70B}
PRESETS = (*MINIGPT_SIZES, *LLAMA_CONFIGS)


@dataclass(frozen=True)
class Vocab:
    size: int
    source: str  # where the number came from, in words


def builtin_vocab_size(data: str = PRETRAIN_DATA) -> int:
    """vocab_size of the tokenizer `minituner pretrain` builds from data (train split only)."""
    return CharTokenizer.train(split_documents(load_documents(data)).train).vocab_size


def minigpt_vocab(tokenizer: str | Path | None = None) -> Vocab:
    """vocab_size from tokenizer (a tokenizer.json), else artifacts/base/tokenizer.json, else rebuilt."""
    if tokenizer is not None:
        return Vocab(read_vocab_size(tokenizer), f"read from {tokenizer}")
    if DEFAULT_TOKENIZER.is_file():
        return Vocab(read_vocab_size(DEFAULT_TOKENIZER), f"read from {DEFAULT_TOKENIZER}")
    return Vocab(builtin_vocab_size(), f"rebuilt from {PRETRAIN_DATA} as pretraining builds it")


def preset_context(name: str) -> int:
    """The longest sequence a preset's model takes: MiniGPT's block_size, else its config's max_position_embeddings
    (LLaMA-7B's 2,048 by default, Llama-2-70B's 4,096)."""
    if name in MINIGPT_SIZES:
        return GPTConfig(vocab_size=1, **MINIGPT_SIZES[name]).block_size
    if name not in LLAMA_CONFIGS:
        raise InputError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return decoder_config_from_hf(LLAMA_CONFIGS[name], name, check_rope=False).block_size


def simplified_shape(d_model: int, n_layer: int) -> ModelShape:
    """Theory 02's simplified block: four h x h projections and h -> 4h -> h, no biases (12 h^2 per layer)."""
    return minigpt_shape(GPTConfig(vocab_size=1, block_size=1, n_layer=n_layer, n_head=1, d_model=d_model,
                                   bias=False), f"simplified-{d_model}x{n_layer}")


def preset_shape(name: str, vocab_size: int | None = None) -> ModelShape:
    """A built-in shape; MiniGPT presets take vocab_size (default: minigpt_vocab())."""
    if name in MINIGPT_SIZES:
        vocab = vocab_size if vocab_size is not None else minigpt_vocab().size
        return minigpt_shape(GPTConfig(vocab_size=vocab, **MINIGPT_SIZES[name]), name)
    if name in LLAMA_CONFIGS:
        return shape_from_config(LLAMA_CONFIGS[name], name)
    raise InputError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")

"""The tokenizers instruction data meets, behind three functions: MiniGPT's CharTokenizer, minituner's HFTokenizer,
a ``tokenizers.Tokenizer`` or a transformers tokenizer. ``plain_encoder`` (text -> ids, no special tokens added),
``offset_encoder`` (ids and each id's character span, where the tokenizer gives them) and ``special_prefix`` (the
ids a tokenizer puts before plain text by itself: Llama's BOS)."""
from __future__ import annotations

from typing import Callable

from .answers import Span


def _backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a tokenizer (itself, or minituner's HFTokenizer's), else None."""
    try:
        import tokenizers
    except ImportError:
        return None
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend", None)
    return backend if isinstance(backend, tokenizers.Tokenizer) else None


def special_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before plain text by itself (Llama's BOS; [] for GPT-2, Qwen and MiniGPT).

    Text and prompt-completion records start with them, as ``tokenizer(text)`` starts in TRL; chat templates
    write their own BOS.
    """
    backend = _backend(tokenizer)
    if backend is not None:
        with_special = backend.encode("a", add_special_tokens=True).ids
    elif hasattr(tokenizer, "apply_chat_template"):
        with_special = tokenizer.encode("a", add_special_tokens=True)
    else:
        return []
    plain = plain_encoder(tokenizer)("a")
    n = len(with_special) - len(plain)
    return list(with_special[:n]) if n > 0 and with_special[n:n + len(plain)] == plain else []


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> ids without added special tokens, for MiniGPT's CharTokenizer, transformers or `tokenizers`."""
    backend = _backend(tokenizer)
    if backend is not None:
        return lambda s: backend.encode(s, add_special_tokens=False).ids
    if hasattr(tokenizer, "apply_chat_template"):  # a transformers tokenizer
        return lambda s: tokenizer.encode(s, add_special_tokens=False)
    return tokenizer.encode


def offset_encoder(tokenizer) -> Callable[[str], tuple[list[int], list[Span]]] | None:
    """text -> (ids, each id's character span) without added special tokens, for `tokenizers` and transformers'
    fast tokenizers; None for a tokenizer that gives no offsets (MiniGPT's characters: pieces tokenize alike)."""
    backend = _backend(tokenizer)
    if backend is not None:
        def encode(s: str):
            e = backend.encode(s, add_special_tokens=False)
            return e.ids, e.offsets
        return encode
    if hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "is_fast", False):
        def encode_fast(s: str):
            e = tokenizer(s, add_special_tokens=False, return_offsets_mapping=True)
            return e["input_ids"], [tuple(o) for o in e["offset_mapping"]]
        return encode_fast
    return None

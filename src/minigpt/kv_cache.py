"""A key/value cache for generation: each new token attends to the keys and values already computed for the
tokens before it, instead of the model reading the whole context again at every step.

    cache = model.new_kv_cache(capacity=prompt_len + max_new_tokens)
    logits = model(prompt_ids, cache=cache)       # prefill: every layer stores the prompt's keys and values
    logits = model(next_id[:, None], cache=cache)  # one token: positions continue at cache.length

Each layer's keys and values live in one tensor preallocated to ``capacity`` tokens, (B, kv heads, capacity,
head_dim), in the dtype the layer computes them in, and are written in place. A step costs one token's
products per layer plus attention over the stored keys: O(T) instead of O(T^2) per token. Only inference uses
it: a forward with a cache is refused while autograd records (the cache is written in place), and so is a
batch of another size than the one it stores. ``minigpt.sampling.generate`` makes one per call.
"""
from __future__ import annotations

import torch

from .errors import InputError


class LayerKV:
    """One layer's stored keys and values; ``update`` appends a step's and returns all so far."""

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache
        self.keys: torch.Tensor | None = None  # (B, kv, capacity, hd)
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, kv, T, hd) at positions cache.length.. and return the keys and values of every position
        so far, (B, kv, cache.length + T, hd) views of the stored tensors."""
        start, T = self.cache.length, k.size(2)
        if self.keys is None:
            shape = (k.size(0), k.size(1), self.cache.capacity, k.size(3))
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        self.keys[:, :, start:start + T] = k
        self.values[:, :, start:start + T] = v
        return self.keys[:, :, :start + T], self.values[:, :, :start + T]


class KVCache:
    """Every layer's keys and values for up to `capacity` positions, and how many positions are filled."""

    def __init__(self, n_layer: int, capacity: int) -> None:
        if capacity < 1:
            raise InputError(f"a KV cache needs a capacity of at least one token, got {capacity}")
        self.capacity = capacity
        self.length = 0  # positions stored (the next token's position)
        self.layers = [LayerKV(self) for _ in range(n_layer)]

    def check_room(self, batch: int, T: int) -> int:
        """The position the next (batch, T) tokens start at; refuses what the cache cannot take."""
        if torch.is_grad_enabled():
            raise InputError("a KV cache is for generation: call the model under torch.no_grad()")
        stored = self.layers[0].keys
        if stored is not None and stored.size(0) != batch:
            raise InputError(f"KV cache holds a batch of {stored.size(0)}, got {batch}")
        if self.length + T > self.capacity:
            raise InputError(f"KV cache holds {self.capacity} positions: {self.length} stored, {T} more do not fit")
        return self.length

    def advance(self, T: int) -> None:
        """Every layer has stored T more positions (the model calls this after its last layer)."""
        self.length += T


def attention_mask(T: int, start: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of the start + T keys each of T queries at positions start.. sees: bool (T, start + T), True = sees.

    Causal, and with `window` at most that many keys back (self included). None when every query sees every
    stored key (one query and no window cutting in), so attention needs no mask."""
    if T == 1 and (window is None or start + 1 <= window):
        return None
    q = torch.arange(start, start + T, device=device)[:, None]
    k = torch.arange(start + T, device=device)[None, :]
    d = q - k  # query position - key position
    return (d >= 0) & (d < window) if window is not None else d >= 0

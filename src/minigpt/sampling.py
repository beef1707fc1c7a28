"""Autoregressive sampling shared by MiniGPT and Decoder: greedy, temperature and top-k, stopping at end tokens."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             eos_id: int | list[int] | None = None, use_cache: bool = True) -> torch.Tensor:
    """Sample up to max_new_tokens continuations of idx (B, T) from `model` (ids -> logits); temperature 0 is greedy.

    With eos_id (one id or several), a row that samples one keeps emitting it, and sampling stops once
    every row has; the result may then be shorter than T + max_new_tokens.
    With `use_cache` and a model that makes one (``new_kv_cache``), the prompt is read once and each step
    feeds only the newest token (minigpt.kv_cache). Once the text outgrows the context (block_size), every step
    reads the last block_size tokens afresh at positions 0.., as without a cache.
    """
    was_training = model.training
    model.eval()
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id or []), device=idx.device)
    done = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
    block = model.config.block_size
    cache = None
    if use_cache and hasattr(model, "new_kv_cache") and 0 < idx.size(1) < block and max_new_tokens > 0:
        cache = model.new_kv_cache(min(block, idx.size(1) + max_new_tokens))
    for _ in range(max_new_tokens):
        if cache is not None and cache.length + 1 > cache.capacity:
            cache = None  # the text has outgrown the context: read the last window afresh from now on
        if cache is None:
            logits = model(idx[:, -block:])
        else:  # the prompt on the first step, then only the token sampled last
            logits = model(idx[:, cache.length:], cache=cache)
        logits = logits[:, -1, :].float()  # (B, V)
        if (bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any())
                or bool(torch.isneginf(logits).all(dim=-1).any())):  # (-inf at some tokens: those are never drawn)
            raise FloatingPointError("the model's logits are not finite (nan, +inf, or -inf at every token): its "
                                     "weights hold nan or inf, or its config's numbers make them (norm eps, "
                                     "rope theta)")
        scaled = logits / temperature if temperature > 0 else None
        if scaled is None or not bool(torch.isfinite(scaled.amax(dim=-1)).all()):
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1): greedy, or a temperature so small that l / t
        else:  # overflows (1e-45: the softmax is greedy's one-hot there)
            logits = scaled
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
        if eos.numel():
            nxt = torch.where(done, eos[0], nxt)  # finished rows repeat their end token
            done = done | torch.isin(nxt, eos)
        idx = torch.cat([idx, nxt], dim=1)
        if eos.numel() and bool(done.all()):
            break
    model.train(was_training)
    return idx

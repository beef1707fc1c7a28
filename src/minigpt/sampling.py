"""Autoregressive sampling shared by MiniGPT and Decoder: greedy, temperature and top-k, stopping at end tokens."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             eos_id: int | list[int] | None = None) -> torch.Tensor:
    """Sample up to max_new_tokens continuations of idx (B, T) from `model` (ids -> logits); temperature 0 is greedy.

    With eos_id (one id or several), a row that samples one keeps emitting it, and sampling stops once
    every row has; the result may then be shorter than T + max_new_tokens.
    """
    was_training = model.training
    model.eval()
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id or []), device=idx.device)
    done = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size :]
        logits = model(context)[:, -1, :].float()  # (B, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
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

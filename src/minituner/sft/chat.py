"""Ask a model a question through its chat template: the prompt, the sampling, and the answer cut at EOS."""
from __future__ import annotations

import torch
import torch.nn as nn

from .examples import plain_encoder
from .templates import ChatTemplate


def chat_prompt(template: ChatTemplate, user: str, system: str | None = None) -> str:
    """The string a model sees before it answers: the conversation rendered with add_generation_prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return template.render(messages, add_generation_prompt=True)


def cut_answer(text: str, template: ChatTemplate) -> str:
    """A generated continuation up to (not including) the first EOS text; all of it when there is none."""
    end = text.find(template.eos_token)
    return text if end < 0 else text[:end]


def answer(model: nn.Module, tokenizer, template: ChatTemplate, user: str, system: str | None = None,
           max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> str:
    """Sample the model's answer (MiniGPT.generate: greedy at temperature 0), cut at EOS."""
    device = next(model.parameters()).device
    ids = plain_encoder(tokenizer)(chat_prompt(template, user, system))
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return cut_answer(tokenizer.decode(out[0, len(ids):].tolist()), template)

"""Ask a model a question through its chat template: the prompt, the sampling, and the answer cut where it ends."""
from __future__ import annotations

import torch
import torch.nn as nn

from minigpt.errors import InputError

from .encoders import plain_encoder
from .templates import ChatTemplate


def chat_prompt(template: ChatTemplate, user: str, system: str | None = None) -> str:
    """The string a model sees before it answers: the conversation rendered with add_generation_prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return template.render(messages, add_generation_prompt=True)


def cut_answer(text: str, template: ChatTemplate) -> str:
    """A generated continuation up to (not including) the first text that ends a turn (the EOS, or a special
    token such as <|im_end|> or <end_of_turn>); all of it when there is none."""
    ends = [i for m in template.end_markers if m and (i := text.find(m)) >= 0]
    return text[:min(ends)] if ends else text


def stop_ids(tokenizer, template: ChatTemplate) -> list[int]:
    """The ids that stop sampling an answer: the folder's eos ids (generation_config.json, config.json) and every
    end marker of the template that is one token (<|eot_id|>, <|im_end|>, <end_of_turn>, </s>)."""
    encode = plain_encoder(tokenizer)
    single = [ids[0] for m in template.end_markers if m and len(ids := encode(m)) == 1]
    return list(dict.fromkeys([*getattr(tokenizer, "eos_ids", []), *single]))


def answer(model: nn.Module, tokenizer, template: ChatTemplate, user: str, system: str | None = None,
           max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> str:
    """Sample the model's answer (greedy at temperature 0), stopping at a stop id (stop_ids), cut where it ends."""
    device = next(model.parameters()).device
    ids = plain_encoder(tokenizer)(chat_prompt(template, user, system))
    if not ids:
        raise InputError(f"the chat template ({template.origin}) renders the question as no text")
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator,
                         eos_id=stop_ids(tokenizer, template) or None)
    return cut_answer(tokenizer.decode(out[0, len(ids):].tolist()), template)

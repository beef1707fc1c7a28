"""The model's own dropout, read from its config and set for a run (``finetune --model-dropout``,
``memory-check --model-dropout``): MiniGPT's ``dropout`` (a GPT-2 folder's ``resid_pdrop``: attention, residual
and embeddings) or a Decoder's ``attention_dropout`` (the llama family's). LoRA's own dropout is LoRAConfig's."""
from __future__ import annotations

import torch.nn as nn

from minigpt.decoder import DecoderConfig
from minigpt.model import GPTConfig

from .planner.activations import check_dropout_range


def config_dropout(cfg: GPTConfig | DecoderConfig) -> float:
    """The dropout a model's config trains it with: MiniGPT's (GPT-2's resid_pdrop) or a Decoder's attention_dropout."""
    return max(float(getattr(cfg, name, 0.0) or 0.0) for name in ("dropout", "attention_dropout"))


def set_model_dropout(model: nn.Module, p: float) -> None:
    """The model's dropout set to p everywhere: its config (so a saved config records what it trained with), every
    nn.Dropout and attention's dropout_p. Call it before LoRA wraps the Linears, whose dropout is LoRAConfig's."""
    check_dropout_range(p, "the model's dropout")
    for name in ("dropout", "attention_dropout"):  # MiniGPT's config field, the Decoder's
        if hasattr(model.config, name):
            setattr(model.config, name, p)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        if hasattr(m, "dropout") and isinstance(m.dropout, float):  # attention's dropout_p
            m.dropout = p

"""MiniGPT: the base model, tokenizer, data and pretraining of the Phase 28 labs."""
from .errors import InputError
from .model import GPTConfig, MiniGPT
from .tokenizer import CharTokenizer

__all__ = ["GPTConfig", "MiniGPT", "CharTokenizer", "InputError"]

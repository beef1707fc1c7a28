"""Supervised fine-tuning data: JSONL/JSON instruction and chat sets, chat templates, answer-only loss masks.

formats (read and check records) -> templates (render chats as transformers does) -> examples (tokens and
labels, -100 outside the answers) -> batches (padded (x, y) batches, evaluation over the counted tokens).
"""
from .batches import EvalResult, ExampleSampler, collate, evaluate_examples, iter_batches
from .examples import IGNORE, Example, SFTConfig, SFTStats, plain_encoder, record_text, tokenize_record, tokenize_records
from .formats import FORMATS, Record, read_file, read_records, split_records
from .templates import DEFAULT_EOS, DEFAULT_TEMPLATE, ChatTemplate, default_template, load_chat_template

__all__ = [
    "ChatTemplate", "DEFAULT_EOS", "DEFAULT_TEMPLATE", "EvalResult", "Example", "ExampleSampler", "FORMATS", "IGNORE",
    "Record", "SFTConfig", "SFTStats", "collate", "default_template",
    "evaluate_examples", "iter_batches", "load_chat_template", "load_records",
    "plain_encoder", "read_file", "read_records", "record_text", "split_records", "tokenize_record",
    "tokenize_records",
]

"""Supervised fine-tuning data: JSONL/JSON instruction and chat sets, chat templates, answer-only loss masks.

files (find and read the records on disk: JSON lines, JSON, Parquet, Arrow; dataset_card: the configs a Hub
snapshot's card declares) -> formats (the shapes a record takes, and the splits) -> templates (render chats as
transformers does) -> answers (where a chat's answers are) -> examples (tokens and labels, -100 outside the
answers; encoders: the tokenizers it meets) -> batches (padded (x, y) batches, evaluation over the counted tokens).
builtin holds ``builtin:forecast-qa``; load ties them together for a command's ``--data``; chat asks a model a
question through the template.
"""
from .batches import (EvalResult, ExampleSampler, LargestBatch, collate, evaluate_examples, iter_batches,
                      largest_batch)
from .builtin import builtin_records, forecast_qa
from .chat import answer, chat_prompt, cut_answer
from .encoders import plain_encoder, special_prefix
from .examples import (IGNORE, Example, SFTConfig, SFTStats, examples_sha256, record_pieces, record_text,
                       tokenize_record, tokenize_records)
from .files import read_file, read_records
from .formats import FORMATS, Columns, DataSelection, Record, parse_columns, parse_data_splits, split_records
from .load import SFTData, is_sft_source, load_records, plain_text_only, prepare_eval, prepare_sft, split_names
from .templates import (DEFAULT_EOS, DEFAULT_TEMPLATE, ChatTemplate, default_template, load_chat_template,
                        trained_template)

__all__ = [
    "ChatTemplate", "Columns", "DataSelection", "DEFAULT_EOS", "DEFAULT_TEMPLATE", "EvalResult", "Example", "ExampleSampler", "FORMATS", "IGNORE",
    "LargestBatch", "Record", "SFTConfig", "SFTData", "SFTStats", "answer", "builtin_records", "chat_prompt", "collate",
    "cut_answer", "default_template", "evaluate_examples", "examples_sha256", "forecast_qa", "is_sft_source",
    "iter_batches", "largest_batch", "load_chat_template", "load_records", "parse_columns", "parse_data_splits", "plain_encoder", "plain_text_only",
    "prepare_eval", "prepare_sft", "read_file", "read_records", "record_pieces", "record_text", "special_prefix",
    "split_names", "split_records", "tokenize_record", "tokenize_records", "trained_template",
]

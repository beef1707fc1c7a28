"""Supervised fine-tuning data: JSONL/JSON instruction and chat sets, chat templates, answer-only loss masks."""

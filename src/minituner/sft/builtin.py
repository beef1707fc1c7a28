"""``builtin:forecast-qa``: questions about the built-in weather bulletins, answered from the bulletin.

Each record is a conversation of one user turn (a bulletin, a newline, a question) and one assistant turn
(the answer, read from the bulletin)::

    user:      "Bergen, 3 Jan: wind south-west 7 to 8, rain, 12 C.\\nWhat is the wind force?"
    assistant: "7 to 8"

The bulletins are minigpt.data.forecast_documents (the ``builtin:forecasts`` corpus), cut before their pressure,
sea state and visibility so that a record fits MiniGPT's 128-token context with the default template. The
question is drawn per bulletin from QUESTIONS by a seeded generator; splits follow split_records (of every 20
records one to val, one to test), so val and test hold bulletins the training set never showed. Every character
is one MiniGPT's tokenizer saw in the Python docs (a test checks it).
"""
from __future__ import annotations

import random
import re

from minigpt.data import forecast_documents
from minigpt.errors import InputError

from .formats import SPLITS, Record, split_records

BULLETIN = re.compile(r"^(?P<bulletin>(?P<place>[^,]+), (?P<date>\d+ \w+): wind (?P<direction>[a-z-]+) "
                      r"(?P<force>\d+(?: to \d+)?), (?P<weather>[^,]+), (?P<temperature>-?\d+ C)), pressure ")
QUESTIONS = {  # field of BULLETIN -> question
    "force": "What is the wind force?",
    "direction": "What is the wind direction?",
    "weather": "What is the weather like?",
    "temperature": "What is the temperature?",
    "place": "Which place is it for?",
    "date": "What is the date?",
}


def forecast_qa(n: int = 4000, seed: int = 28) -> list[Record]:
    """n question-answer conversations about the first n bulletins of forecast_documents(n, seed)."""
    rng = random.Random(seed + 1)
    records = []
    for i, doc in enumerate(forecast_documents(n, seed)):
        m = BULLETIN.match(doc)
        if m is None:  # the generator changed shape: fail loudly rather than ask unanswerable questions
            raise RuntimeError(f"forecast bulletin {i} does not parse: {doc!r}")
        field = rng.choice(sorted(QUESTIONS))
        user = f"{m['bulletin']}.\n{QUESTIONS[field]}"
        records.append(Record("messages", f"builtin:forecast-qa:{i + 1}",
                              messages=({"role": "user", "content": user}, {"role": "assistant", "content": m[field]})))
    return records


BUILTIN_SFT = {"forecast-qa": forecast_qa}


def builtin_records(name: str, split: str | None = None) -> list[Record]:
    """A built-in instruction set, whole or one of its splits."""
    if name not in BUILTIN_SFT:
        raise InputError(f"unknown built-in instruction set {name!r}; valid: {sorted(BUILTIN_SFT)}")
    records = BUILTIN_SFT[name]()
    if split is None:
        return records
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return split_records(records)[split]

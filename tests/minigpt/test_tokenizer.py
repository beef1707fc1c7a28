import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minigpt.errors import InputError
from minigpt.tokenizer import CharTokenizer, read_vocab_size


def test_round_trip_and_file(tmp_path):
    text = "def f(x):\n    return x ** 2  # ünïcode\n"
    tok = CharTokenizer.train(text)
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path / "tokenizer.json")
    again = CharTokenizer.load(tmp_path / "tokenizer.json")
    assert again.itos == tok.itos
    assert read_vocab_size(tmp_path / "tokenizer.json") == tok.vocab_size == len(set(text)) + 1


def test_deterministic():
    assert CharTokenizer.train("banana").itos == CharTokenizer.train("nabana").itos


def test_unseen_characters_map_to_unk():
    tok = CharTokenizer.train("abc")
    assert tok.encode("abz") == [tok.stoi["a"], tok.stoi["b"], 0]
    assert tok.unknown_count("abzz") == 2


@given(st.text(min_size=1, max_size=200))
def test_round_trip_any_text_in_vocab(text):
    tok = CharTokenizer.train(text)
    assert tok.decode(tok.encode(text)) == text


def test_corrupt_tokenizer_file_is_input_error(tmp_path):
    p = tmp_path / "tokenizer.json"
    p.write_text("{not json")
    with pytest.raises(InputError):
        CharTokenizer.load(p)
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(InputError):
        CharTokenizer.load(p)
    with pytest.raises(InputError, match="not found"):
        CharTokenizer.load(tmp_path / "missing.json")

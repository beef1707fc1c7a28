"""minituner.finetune_data: the check for text the base tokenizer cannot encode looks at what training encodes."""
import json

import pytest

from minigpt.errors import InputError
from minigpt.tokenizer import CharTokenizer
from minituner.cli import main
from minituner.finetune_data import unknown_fraction
from minituner.tokenizer_files import HFTokenizer


@pytest.fixture
def word_tokenizer(hf_folder):
    return HFTokenizer(hf_folder("llama") / "tokenizer.json")


def test_pieces_are_checked_one_by_one_as_training_encodes_them(word_tokenizer):
    # joined, '</s>' and 'calm' would read as one unknown word '</s>calm'; training encodes them apart
    assert unknown_fraction(["the wind is", " calm", "</s>", "cold", "</s>"], word_tokenizer, "d.jsonl", False) == 0.0


def test_unknown_words_are_named_and_counted(word_tokenizer):
    with pytest.raises(InputError, match=r"d\.jsonl: 1 pieces of text the base tokenizer never saw \('gale'\)"):
        unknown_fraction(["the gale", "</s>"], word_tokenizer, "d.jsonl", False)
    assert unknown_fraction(["the gale", "</s>"], word_tokenizer, "d.jsonl", True) == pytest.approx(4 / 12)


def test_unknown_characters_of_a_character_tokenizer():
    tok = CharTokenizer.train("abc ")
    with pytest.raises(InputError, match=r"2 characters the base tokenizer never saw \('x', 'y'\)"):
        unknown_fraction(["ab x", "cy"], tok, "d.txt", False)
    assert unknown_fraction(["ab x", "cy"], tok, "d.txt", True) == pytest.approx(2 / 6)


def test_instruction_data_whose_every_word_the_tokenizer_knows_trains(hf_folder, tmp_path, capsys):
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": "the wind is", "completion": f" {w}"}) + "\n"
                            for w in ["calm", "cold", "warm", "sunny"] * 3))
    code = main(["finetune", "--base", str(hf_folder("llama")), "--data", str(data), "--steps", "1", "--batch-size", "2",
                 "--base-domain", "none", "--no-progress", "--seq-len", "16", "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "adapter_final.safetensors").exists()

"""builtin:forecast-qa: deterministic, answerable from its bulletin, encodable by MiniGPT's tokenizer, fits 128."""
import pytest

from minigpt.data import load_documents, split_documents
from minigpt.errors import InputError
from minigpt.tokenizer import CharTokenizer
from minituner.sft import (ExampleSampler, SFTConfig, default_template, is_sft_source, load_chat_template,
                           load_records, prepare_eval, prepare_sft, record_text, tokenize_records)
from minituner.sft.builtin import QUESTIONS, builtin_records, forecast_qa


@pytest.fixture(scope="module")
def minigpt_tokenizer():
    """The tokenizer `minituner pretrain` builds: the characters of the python-docs train split."""
    return CharTokenizer.train(split_documents(load_documents("builtin:python-docs")).train)


def test_deterministic_and_answerable():
    a, b = forecast_qa(), forecast_qa()
    assert a == b and len(a) == 4000 and forecast_qa(50, seed=3) != forecast_qa(50)
    for r in a:
        user, answer = r.messages[0]["content"], r.messages[1]["content"]
        bulletin, question = user.split("\n")
        assert question in QUESTIONS.values() and answer and answer in bulletin
    assert {r.messages[0]["content"].split("\n")[1] for r in a} == set(QUESTIONS.values())
    assert a[0].messages[1]["content"] == "3 C"
    assert a[0].messages[0]["content"].startswith("Stavanger, 8 Mar: wind east 9,")


def test_splits_are_disjoint_and_fixed():
    train, val, test = (builtin_records("forecast-qa", s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (3600, 200, 200)
    assert not {r.where for r in val} & {r.where for r in train}
    assert val[0].where == "builtin:forecast-qa:19" and test[0].where == "builtin:forecast-qa:20"
    with pytest.raises(InputError, match="unknown split"):
        builtin_records("forecast-qa", "dev")
    with pytest.raises(InputError, match="unknown built-in instruction set"):
        load_records("builtin:nope")
    assert is_sft_source("builtin:forecast-qa") and not is_sft_source("builtin:forecasts")


def test_every_character_is_known_to_minigpt_and_every_example_fits(minigpt_tokenizer, tmp_path):
    template = load_chat_template(tmp_path)  # a MiniGPT base folder has no template: the default
    text = "".join(record_text(r, template) for r in forecast_qa())
    assert minigpt_tokenizer.unseen_characters(text) == []
    examples, stats = tokenize_records(forecast_qa(), minigpt_tokenizer, template, block_size=128)
    assert stats.examples == 4000 and stats.truncated == stats.dropped == stats.dropped_empty == 0
    assert stats.longest <= 129
    # counted = answer characters + the 7 characters of <|end|>
    assert stats.counted_tokens == sum(len(r.messages[1]["content"]) + 7 for r in forecast_qa())


def test_prepare_sft_end_to_end(minigpt_tokenizer):
    import torch

    data = prepare_sft("builtin:forecast-qa", minigpt_tokenizer, default_template(), 128, SFTConfig())
    assert (len(data.train), len(data.val)) == (3600, 200)  # the test split is held out
    x, y = ExampleSampler(data.train)(16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape and x.shape[0] == 16 and x.shape[1] <= 128
    with pytest.raises(InputError, match="fixed format"):
        load_records("builtin:forecast-qa", "text")


def test_prepare_eval_takes_a_whole_file_or_a_split(minigpt_tokenizer, tmp_path):
    val, stats = prepare_eval("builtin:forecast-qa", minigpt_tokenizer, default_template(), 128, split="test")
    assert len(val) == stats.examples == 200
    p = tmp_path / "qa.jsonl"
    p.write_text('{"prompt": "Q: 2+2?\\nA: ", "completion": "4"}\n' * 3)
    ex, stats = prepare_eval(p, minigpt_tokenizer, default_template(), 128)
    assert len(ex) == 3 and stats.counted_tokens == 3 * (1 + 7)
    with pytest.raises(InputError, match="no example to evaluate fits block_size 4"):
        prepare_eval(p, minigpt_tokenizer, default_template(), 4, SFTConfig(overlong="drop"))
    with pytest.raises(InputError, match="unknown split"):
        prepare_eval(p, minigpt_tokenizer, default_template(), 128, split="dev")

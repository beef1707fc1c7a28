import math

import pytest
import torch

from minigpt.data import (
    encode_split, forecast_documents, load_documents, python_docs_documents, sample_batch, split_documents,
    unigram_entropy,
)
from minigpt.errors import InputError


def test_builtin_corpora_are_deterministic_and_distinct():
    docs = python_docs_documents()
    assert len(docs) > 1000 and docs == python_docs_documents()
    fc = forecast_documents()
    assert fc == forecast_documents() and len(fc) == 4000
    assert "hPa" in fc[0] and not any("hPa" in d for d in docs[:500])


def test_split_is_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(100)]
    s = split_documents(docs)
    assert s == split_documents(docs)
    assert "doc 18\n" in s.val and "doc 19\n" in s.test and "doc 18\n" not in s.train
    assert s.train.count("doc") == 90 and s.val.count("doc") == 5 and s.test.count("doc") == 5



def test_few_documents_are_split_at_whitespace_with_nothing_added():
    """Under 20 documents the joined text is split: the last two twentieths val, then test, at whitespace. Before,
    it was cut into 20 equal pieces joined by blank lines: 'the w\n\nind i\n\ns cal...' (words cut, text added)."""
    docs = ["the wind is calm today and tomorrow " * 6, "the sea is flat and the sky is clear " * 6]
    s = split_documents(docs)
    text = "\n\n".join(docs)
    assert s.train + s.val + s.test == text and s.val and s.test
    assert len(s.train) <= 0.9 * len(text) + 10 and len(s.val) <= 0.05 * len(text) + 10
    words = set(text.split())
    assert all(set(part.split()) <= words for part in (s.train, s.val, s.test))
    assert split_documents(["風が静かです今日は明日も" * 4]).val  # no whitespace: cut where it falls

def test_user_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\n\nsecond one\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("third\n")
    assert load_documents(tmp_path) == ["first paragraph", "second one", "third"]
    assert load_documents(tmp_path / "a.txt") == ["first paragraph", "second one"]


def test_a_folder_skips_hidden_folders_and_refuses_models_and_runs(tmp_path):
    """A corpus kept in git: .git's suffixless files (HEAD, description) are not text to learn; a model or a run
    kept under the corpus is refused, not read (an exported tokenizer's merges.txt would have been), unless hidden."""
    (tmp_path / "a.txt").write_text("first paragraph\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "description").write_text("Unnamed repository\n")
    assert load_documents(tmp_path) == ["first paragraph"]
    model = tmp_path / ".cache" / "gpt2"
    model.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "merges.txt"):
        (model / name).write_text("x\n")
    assert load_documents(tmp_path) == ["first paragraph"]  # hidden: neither read nor refused
    (tmp_path / ".cache").rename(tmp_path / "models")
    with pytest.raises(InputError, match="models/gpt2 holds a model or a training run .config.json, model.safetensors"):
        load_documents(tmp_path)
    with pytest.raises(InputError, match="the folder holds a model or a training run"):
        load_documents(tmp_path / "models" / "gpt2")


@pytest.mark.parametrize("make", ["missing", "empty", "blank", "binary"])
def test_bad_data_is_input_error(tmp_path, make):
    p = tmp_path / "data.txt"
    if make == "empty":
        p.write_text("")
    elif make == "blank":
        p.write_text("\n\n   \n")
    elif make == "binary":
        p.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(InputError):
        load_documents(p)


def test_unknown_builtin():
    with pytest.raises(InputError, match="python-docs"):
        load_documents("builtin:nope")


def test_batches_are_next_token_windows():
    data = torch.arange(100)
    x, y = sample_batch(data, 4, 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)


def test_too_short_split_is_input_error():
    from minigpt.tokenizer import CharTokenizer

    with pytest.raises(InputError, match="fewer than block_size"):
        encode_split("abc", CharTokenizer.train("abc"), 16, "val")


def test_unigram_entropy_uniform():
    ids = torch.arange(8).repeat(10)
    assert abs(unigram_entropy(ids, 8) - math.log(8)) < 1e-12

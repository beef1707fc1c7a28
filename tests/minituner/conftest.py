"""Tiny random Hugging Face folders (llama, mistral, qwen2, gpt2) written by transformers' save_pretrained.

Weights are drawn with a fixed seed at a scale (std 0.2, norm weights 1 ± 0.2) where logits differ
clearly between positions, so a parity of 1e-4 is a real check. The tokenizer is a WordLevel
``tokenizers`` model built in the test (no downloads). Folders are built once per session and cached.
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORDS = "the wind is calm rain later sunny cold warm front north south east west".split()

BASE = {
    "llama": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=40, max_position_embeddings=64),
    "mistral": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, sliding_window=4),
    "qwen2": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=40, max_position_embeddings=64),
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64, vocab_size=40),
}


def write_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def make_hf_model(family: str, seed: int = 0, **overrides):
    """transformers' model of a tiny config, with seeded random weights at a telling scale (fp32)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(family, **{**BASE[family], **overrides})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("weight") else
                        0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(family, name=..., dtype=..., max_shard_size=..., **config) -> a cached saved folder."""
    import torch

    cache = {}

    def build(family: str, name: str | None = None, dtype=torch.float32, max_shard_size: str | None = None,
              seed: int = 0, **overrides):
        key = name or f"{family}-{sorted(overrides.items())}-{dtype}-{max_shard_size}-{seed}"
        if key not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = make_hf_model(family, seed, **overrides).to(dtype)
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bar: not the
                model.save_pretrained(folder, **kwargs)  # stderr of the test that first asks for this folder
            write_tokenizer(folder)
            cache[key] = folder
        return cache[key]

    return build


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """Plain text over the fixture tokenizer's words: 300 paragraphs of 8 words (a module may define its own)."""
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "words.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(300)))
    return path


@pytest.fixture(scope="session")
def hf_words() -> list[str]:
    """The words the fixture tokenizer knows (each one token)."""
    return list(WORDS)


@pytest.fixture(scope="session")
def hf_ref():
    """The transformers model of a folder, fp32, eval mode."""
    import transformers

    def load(folder, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()

    return load


@pytest.fixture
def datasets_offline(monkeypatch, tmp_path):
    """datasets and the Hub offline (nothing to download here), datasets' cache in the test's folder, no bars."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


@pytest.fixture
def cli(capsys):
    """cli(*argv) -> (exit code, stdout, stderr) of `minituner` run in this process, each call's output alone."""
    from minituner.cli import main

    def run(*argv):
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run

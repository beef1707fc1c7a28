"""Issue 7, item 1 end to end: LoRA and QLoRA fine-tunes of an imported GPT-2 folder, and `count` on its config."""
import json
import string
import subprocess
import sys

import pytest
import torch

from minigpt.tokenizer import CharTokenizer
from minituner.base_model import load_base

transformers = pytest.importorskip("transformers")

VOCAB_CHARS = list(string.ascii_lowercase + " .,\n") + list("0123456789")  # 40 characters + <unk>
CFG = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=len(VOCAB_CHARS) + 1, n_positions=32,
           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minituner", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**CFG)).save_pretrained(root / "base", safe_serialization=True)
    CharTokenizer(VOCAB_CHARS).save(root / "base" / "tokenizer.json")
    (root / "data.txt").write_text("\n\n".join(f"station {i % 9} reports wind {i % 5}, rain {i % 3}." for i in range(300)))
    return root


def test_count_agrees_with_imported_model(gpt2_folder):
    model, _ = load_base(gpt2_folder / "base")
    r = run_cli("count", "--config", gpt2_folder / "base" / "config.json", "--rank", 4, "--target", "c_attn", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("extra", [[], ["--qlora"]], ids=["lora", "qlora"])
def test_finetune_gpt2_folder(gpt2_folder, extra):
    out = gpt2_folder / f"run{len(extra)}"
    r = run_cli("finetune", "--base", gpt2_folder / "base", "--data", gpt2_folder / "data.txt", "--rank", 4,
                "--alpha", 8, "--target", "all-linear", "--steps", 20, "--batch-size", 4, "--lr", 1e-2,
                "--out", out, "--no-progress", *extra)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "manifest.json").read_text())["results"]
    # our MiniGPT splits GPT-2's fused c_attn into q/k/v: 2 layers x r(32+32) x 4 + r(32+128) + r(128+32)
    assert summary["params_trainable"] == 2 * (4 * 4 * 64 + 4 * 160 * 2)
    assert summary["val_loss_after"] < summary["val_loss_before"]
    assert (out / "adapter_final.safetensors").is_file()

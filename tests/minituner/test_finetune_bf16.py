"""`minituner finetune --precision bf16` on a tiny base: it trains, records timing, and refuses what it cannot do.

The test machine may or may not have bf16 units: runs pass --allow-slow-bf16, refusals mock the CPU's flags.
"""
import json

import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.data import forecast_documents
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.adapter_io import ADAPTER_FILE, read_adapter
from minituner.cli import main

NO_BF16_UNITS = frozenset({"sse4_2", "avx2", "avx512f"})  # an AVX-512 CPU without avx512_bf16 or amx_bf16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tok = CharTokenizer.train("\n\n".join(forecast_documents(200)))
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=16)), tok,
              folder)
    return folder


def cli(base, out, *args):
    common = ("--base", base, "--out", out, "--rank", 2, "--alpha", 4, "--steps", 4, "--batch-size", 4,
              "--eval-every", 2, "--checkpoint-every", 2, "--no-progress", "--base-domain", "none")
    return main(["finetune", *map(str, common), *map(str, args)])


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("qlora", [False, True])
def test_bf16_finetune_runs_and_records_its_precision_and_speed(base, tmp_path, qlora):
    out = tmp_path / "run"
    assert cli(base, out, "--precision", "bf16", "--allow-slow-bf16", *(["--qlora"] if qlora else [])) == 0
    metrics = rows(out)
    assert len(metrics) == 4 and all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in metrics)
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in metrics)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["train"]["precision"] == "bf16"
    tensors, _ = read_adapter(out / ADAPTER_FILE)
    assert all(t.dtype == torch.float32 for t in tensors.values())  # the LoRA masters are saved fp32


def test_bf16_autocast_is_the_old_name_of_bf16(base, tmp_path):
    out = tmp_path / "run"
    assert cli(base, out, "--precision", "bf16-autocast", "--allow-slow-bf16") == 0
    assert json.loads((out / "manifest.json").read_text())["config"]["train"]["precision"] == "bf16"


def test_bf16_is_refused_on_a_cpu_without_bf16_units(base, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("minigpt.bf16_support.cpu_flags", lambda: NO_BF16_UNITS)
    assert cli(base, tmp_path / "run", "--precision", "bf16", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "this CPU has no bf16 units" in err and "--precision fp32" in err and "--allow-slow-bf16" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert cli(base, tmp_path / "run", "--precision", "bf16", "--device", "cpu", "--allow-slow-bf16") == 0


def test_full_finetune_in_bf16_is_refused(base, tmp_path, capsys):
    assert cli(base, tmp_path / "run", "--full", "--precision", "bf16", "--allow-slow-bf16") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "full fine-tuning trains every weight" in err and "--precision fp32" in err


def test_resume_with_another_precision_is_refused(base, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(base, out, "--steps", 4) == 0
    assert cli(base, out, "--precision", "bf16", "--allow-slow-bf16", "--resume") == 2
    err = capsys.readouterr().err
    assert "precision" in err and err.count("\n") == 1


@pytest.mark.parametrize("units", [True, False])
def test_fp32_lora_on_a_cpu_with_bf16_units_says_bf16_is_there(base, tmp_path, capsys, monkeypatch, units):
    flags = NO_BF16_UNITS | ({"amx_bf16", "avx512_bf16"} if units else set())
    monkeypatch.setattr("minigpt.bf16_support.cpu_flags", lambda: flags)
    assert cli(base, tmp_path / "run", "--device", "cpu") == 0  # fp32, the default
    out = capsys.readouterr()
    note = [line for line in (out.out + out.err).splitlines() if "--precision bf16 would run" in line]
    assert len(note) == (1 if units else 0)
    assert not units or "this CPU has bf16 units (" in note[0]

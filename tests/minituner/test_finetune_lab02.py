"""Lab 02's committed artifacts agree with each other: report, results, manifest, adapter files.

Re-running the lab takes a minute or two, so the test checks what the committed run wrote instead:
REPORT.md is exactly what lab02.render() makes from results.json, the manifest's sha256 is the
adapter's, and both adapter files load into a MiniGPT of the recorded shape with equal tensors.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from minigpt.io import sha256_file
from minigpt.model import GPTConfig, MiniGPT
from minituner.adapter_io import load_adapter
from minituner.lora import lora_state_dict

LAB = Path(__file__).resolve().parents[2] / "experiments" / "28-lora-finetune"
pytestmark = pytest.mark.skipif(not (LAB / "results.json").is_file(), reason="Lab 02 has not been run")


def lab02():
    spec = importlib.util.spec_from_file_location("lab02", LAB / "lab02.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results() -> dict:
    return json.loads((LAB / "results.json").read_text(encoding="utf-8"))


def test_report_is_rendered_from_results():
    assert (LAB / "REPORT.md").read_text(encoding="utf-8") == lab02().render(results())


def test_adapter_improves_the_new_domain_clearly():
    s = results()["summary"]
    assert s["val_loss_after"] < s["val_loss_before"] - 1.0
    assert results()["disabled_val_loss"]["old"] == pytest.approx(s["base_domain_val_loss_before"], abs=1e-6)


def test_manifest_matches_the_committed_adapter_and_results():
    manifest = json.loads((LAB / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["adapter_sha256"] == sha256_file(LAB / "adapter_final.safetensors")
    assert manifest["base_sha256"] == results()["base_sha256"]
    assert manifest["results"] == results()["summary"]
    rows = [json.loads(line) for line in (LAB / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["results"]["steps"]
    assert rows[-1]["val_loss"] == pytest.approx(manifest["results"]["val_loss_after"])


def test_both_adapter_files_load_into_the_recorded_model_shape():
    cfg = GPTConfig.from_dict(results()["model"])
    ours, peft_copy = MiniGPT(cfg), MiniGPT(cfg)
    loaded = load_adapter(ours, LAB / "adapter_final.safetensors")
    assert (loaded.r, loaded.alpha) == (8, 16.0) and len(loaded.target_modules) == 6 * cfg.n_layer
    load_adapter(peft_copy, LAB / "adapter_peft")
    a, b = lora_state_dict(ours), lora_state_dict(peft_copy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(t.numel() for t in a.values()) == results()["summary"]["params_trainable"]


def test_bf16_run_ends_within_one_percent_of_fp32():
    r = results()
    fp32, bf16 = r["summary"]["val_loss_after"], r["bf16"]
    assert bf16["precision"] == "bf16" and bf16["steps"] == r["summary"]["steps"] and bf16["all_finite"]
    assert abs(bf16["val_loss_after"] - fp32) / fp32 <= lab02().BF16_GOAL == 0.01

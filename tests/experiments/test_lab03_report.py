"""Lab 03's committed artifacts agree with each other, with Lab 02 and with the planner.

Re-running the lab takes a minute or more, so the test checks what the committed run wrote: REPORT.md is
exactly lab03.render(results.json); the manifest's hashes are the files'; every figure the planner
predicts is what the planner computes today; the exact memory accounting differs from the planner by
exactly the documented fp32-LoRA and AdamW-step bytes; the trained adapter loads on an NF4 MiniGPT.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from minigpt.io import sha256_file
from minigpt.model import GPTConfig, MiniGPT
from minituner.adapter_io import load_adapter
from minituner.lora import lora_state_dict
from minituner.planner import (MemoryConfig, Regime, lora_trainable_params, minigpt_shape, nf4_weight_bytes, plan,
                               preset_shape, quantized_params, total_params)
from minituner.build import wrap_minigpt_qlora

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "experiments" / "28-qlora-preview"
LAB02 = ROOT / "experiments" / "28-lora-finetune"
pytestmark = pytest.mark.skipif(not (LAB / "results.json").is_file(), reason="Lab 03 has not been run")


@pytest.fixture(scope="module")
def lab03():
    spec = importlib.util.spec_from_file_location("lab03", LAB / "lab03.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((LAB / "results.json").read_text(encoding="utf-8"))


def test_report_is_rendered_from_results(lab03, results):
    assert (LAB / "REPORT.md").read_text(encoding="utf-8") == lab03.render(results)


def test_manifest_hashes_and_lab02_lineage(results):
    manifest = json.loads((LAB / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["adapter_sha256"] == sha256_file(LAB / "adapter_final.safetensors")
    assert manifest["init_adapter_sha256"] == results["lab02_adapter_sha256"] == sha256_file(
        LAB02 / "adapter_final.safetensors")
    lab02 = json.loads((LAB02 / "results.json").read_text(encoding="utf-8"))
    assert manifest["base_sha256"] == results["base_sha256"] == lab02["base_sha256"]  # the same pretrained base
    assert manifest["seed"] == results["C"]["seed"] and "torch" in manifest["versions"]
    assert manifest["finetune_manifest"]["config"]["quant_scheme"] == results["scheme"] == "nf4_per_group_64"


def test_block_a_counts_agree_with_the_planner(results):
    shape, a = minigpt_shape(GPTConfig.from_dict(results["model"])), results["A"]
    targets, r = results["lora"]["target_modules"], results["lora"]["r"]
    expected = {"base": total_params(shape), "trainable": lora_trainable_params(shape, r, targets),
                "quantized": quantized_params(shape, targets), "quantized_bytes": nf4_weight_bytes(shape, False, targets)}
    assert a["planner"] == expected
    assert {k: a["summary"][k] for k in expected} == expected
    assert a["q_proj_types"] == ["LoRALinear", "QuantizedLinear"] and a["q_proj_base_parameters"] == 0


def test_block_b_tolerance_is_checked_and_explained(results):
    b = results["B"]
    nf4 = b["schemes"][-1]
    assert nf4["scheme"] == "nf4_per_group_64" and b["ratio"] == nf4["with_adapter"]["ratio"]
    assert b["within_tolerance"] == (b["ratio"] <= b["tolerance"]) and b["tolerance"] == 0.03
    assert b["bitsandbytes_max_abs_diff"] in (None, 0.0)  # our NF4 logits are bitsandbytes' to the bit
    int8, int4 = b["schemes"][0], b["schemes"][1]
    assert int8["with_adapter"]["ratio"] < b["tolerance"] < nf4["with_adapter"]["ratio"] < int4["with_adapter"]["ratio"]
    assert len(b["single_linear"]) == results["A"]["quantized_layers"] == 24
    assert math.sqrt(sum(v * v for v in b["single_linear"].values())) == pytest.approx(b["ratio"], rel=0.1)


def test_block_c_one_epoch_finite_and_the_loss_goes_down(results):
    c, b = results["C"], results["B"]
    rows = [json.loads(line) for line in (LAB / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == c["steps"] == math.ceil(c["train_tokens"] / (c["batch_size"] * results["model"]["block_size"]))
    assert c["all_finite"] and all(math.isfinite(r["train_loss"]) for r in rows)
    assert rows[-1]["val_loss"] == pytest.approx(c["val_loss_after"])
    assert c["val_loss_after"] < b["schemes"][-1]["val_loss"] and c["last_mean"] < c["first_mean"]
    assert (LAB / "loss_curve.png").read_bytes().startswith(b"\x89PNG")


def test_block_d_exact_bytes_are_the_planner_plus_fp32_lora(results):
    d, cfg = results["D"], GPTConfig.from_dict(results["model"])
    regimes = [Regime("lora", results["lora"]["r"]), Regime("qlora", results["lora"]["r"])]
    mini = plan(minigpt_shape(cfg), regimes, results["lora"]["target_modules"], MemoryConfig())
    big = plan(preset_shape("llama-7b"), regimes, results["lora"]["target_modules"], MemoryConfig())
    assert d["planner"] == {"lora-fp16": mini.regimes[0].bytes.to_dict(), "qlora-nf4": mini.regimes[1].bytes.to_dict()}
    assert d["planner_7b"] == {"lora-fp16": big.regimes[0].bytes.to_dict(), "qlora-nf4": big.regimes[1].bytes.to_dict(),
                               "params": big.total_params}
    p = d["lora_params"]
    for name, row in d["rows"].items():
        planned, after, built = d["planner"][name], row["after_steps"], row["after_build"]
        assert row["steps"] >= 2 and built["weights"] == after["weights"] and built["grads"] == 0
        assert after["weights"] == planned["weights"] + 2 * p  # LoRA factors fp32, not fp16
        assert after["grads"] == planned["grads"] + 2 * p
        assert after["optimizer"] == planned["optimizer"] + 4 * d["lora_tensors"]  # AdamW's 0-d fp32 step
        assert after["total"] == after["weights"] + after["grads"] + after["optimizer"]
    assert d["rows"]["qlora-nf4"]["after_steps"]["total"] < d["rows"]["lora-fp16"]["after_steps"]["total"]


def test_block_e_swap(results):
    e = results["E"]
    assert all(o["finite"] for o in e["adapters"].values()) and e["differ"] and e["base_unchanged"]
    assert e["adapters"]["lab02"]["val_loss"] == pytest.approx(results["B"]["schemes"][-1]["val_loss"], abs=1e-6)
    assert e["adapters"]["qlora"]["val_loss"] == pytest.approx(results["C"]["val_loss_after"], abs=1e-6)


def test_trained_adapter_loads_on_an_nf4_minigpt_in_both_formats(results):
    cfg = GPTConfig.from_dict(results["model"])
    ours = wrap_minigpt_qlora(MiniGPT(cfg), device="cpu", adapter_name="fresh")
    peft_copy = wrap_minigpt_qlora(MiniGPT(cfg), device="cpu", adapter_name="fresh")
    load_adapter(ours, LAB / "adapter_final.safetensors", adapter_name="trained")
    load_adapter(peft_copy, LAB / "adapter_peft", adapter_name="trained")
    a, b = lora_state_dict(ours, "trained"), lora_state_dict(peft_copy, "trained")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(t.numel() for t in a.values()) == results["A"]["summary"]["trainable"]


def test_block_c_in_bf16_stays_finite_and_its_loss_falls(results):
    c = results["C"]
    bf16 = c["bf16"]
    assert bf16["precision"] == "bf16" and bf16["steps"] == c["steps"]
    assert bf16["all_finite"] and bf16["last_mean"] < bf16["first_mean"] and math.isfinite(bf16["val_loss_after"])
    assert bf16["tokens_per_s"] > 0 and c["speed"]["tokens_per_s"] > 0

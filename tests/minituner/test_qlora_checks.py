"""qlora_checks: the numbers Lab 03 reports, on a tiny MiniGPT."""
import math

import pytest
import torch

from minigpt.model import GPTConfig, MiniGPT
from minituner.build import build_for_training, wrap_minigpt_qlora
from minituner.lora import LoRAConfig, apply_lora, load_lora_state_dict, lora_modules, lora_state_dict
from minituner.qlora_checks import (adapter_swap, quantized_fingerprint, scheme_rows, sensitivity,
                                    single_linear_ratios, wrapped_layer)

CFG = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=64)
LORA = LoRAConfig(r=4, target_modules="all-linear")


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CFG).eval()


def trained_adapter() -> tuple:
    model = build_for_training(tiny(), "lora", LORA, device="cpu")
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
    return model, {k: v.clone() for k, v in lora_state_dict(model).items()}


def test_wrapped_layer_counts_agree_with_the_planner():
    a = wrapped_layer(wrap_minigpt_qlora(tiny(), r=4, device="cpu"), "blocks.0.attn.q_proj", LORA)
    assert a["q_proj_types"] == ["LoRALinear", "QuantizedLinear"] and a["q_proj_base_parameters"] == 0
    assert {k: a["summary"][k] for k in ("base", "trainable", "quantized")} == {
        k: a["planner"][k] for k in ("base", "trainable", "quantized")}


def test_scheme_rows_and_single_layers():
    fp, sd = trained_adapter()
    plain, x = tiny(), torch.randint(CFG.vocab_size, (2, CFG.block_size))
    with torch.no_grad():
        ref, ref_base = fp.eval()(x), plain(x)
    rows, logits = scheme_rows(plain, ref, ref_base, lambda s: wrap_minigpt_qlora(tiny(), r=4, quant_scheme=s,
                                                                                  device="cpu"),
                               sd, ("int8_per_group_64", "nf4_per_group_64"), x, lambda m: 1.0)
    int8, nf4 = rows
    assert 0 < int8["weight_error"] < nf4["weight_error"] and int8["with_adapter"]["ratio"] < nf4["with_adapter"]["ratio"]
    assert set(logits) == {"int8_per_group_64", "nf4_per_group_64"} and nf4["val_loss"] == 1.0

    def fresh():
        model, _ = trained_adapter()
        return model.eval()
    single = single_linear_ratios(fresh, list(lora_modules(fp)), "nf4_per_group_64", x, ref)
    assert len(single) == 6 and all(0 < v < nf4["with_adapter"]["ratio"] for v in single.values())
    s = sensitivity(single)
    assert s["single_lo"] <= s["median"] <= s["single_hi"] and s["worst"] in single
    assert s["quadrature"] == pytest.approx(math.sqrt(sum(v * v for v in single.values())))


def test_adapter_swap_leaves_the_base_identical():
    _, sd = trained_adapter()
    model = wrap_minigpt_qlora(tiny(), r=4, device="cpu", adapter_name="a")
    apply_lora(model, LoRAConfig(r=4, target_modules=list(lora_modules(model))), "b")
    load_lora_state_dict(model, sd, adapter_name="b")
    before = quantized_fingerprint(model)
    out = adapter_swap(model, ("a", "b"), torch.randint(CFG.vocab_size, (2, CFG.block_size)), lambda m: 0.5)
    assert out["differ"] and out["base_unchanged"] and out["base_fingerprint"] == before
    assert all(o["finite"] and o["val_loss"] == 0.5 for o in out["adapters"].values())


def test_logit_check_agrees_with_its_parts():
    """logit_check (Lab 03's block B) reports the last scheme's ratio against the tolerance, and bitsandbytes."""
    from minituner.qlora_checks import logit_check

    _, sd = trained_adapter()

    def with_adapter():
        model, _ = trained_adapter()
        return model.eval()
    x = torch.randint(CFG.vocab_size, (2, CFG.block_size))
    build = lambda s: wrap_minigpt_qlora(tiny(), r=4, quant_scheme=s, device="cpu")  # noqa: E731
    b = logit_check(tiny(), with_adapter, build, sd, ("int8_per_group_64", "nf4_per_group_64"), x, lambda m: 1.0,
                    tolerance=0.5)
    assert b["ratio"] == b["schemes"][-1]["with_adapter"]["ratio"] and b["within_tolerance"] == (b["ratio"] <= 0.5)
    assert b["prompts"] == [2, CFG.block_size] and b["fp_val_loss"] == 1.0 and len(b["single_linear"]) == 6
    bnb = b["bitsandbytes_max_abs_diff"]
    assert bnb is None or bnb < 1e-3  # byte-identical NF4: the same logits up to float rounding

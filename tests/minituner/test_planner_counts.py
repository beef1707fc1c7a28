"""Parameter counts: MiniGPT's equal the instantiated model's; Theory 02's figures; targets and errors."""
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minituner.planner import (KINDS, LinearShape, adapter_bytes, block_linear_weights, lora_params,
                               lora_trainable_params, minigpt_shape, param_counts, preset_shape, resolve_targets,
                               simplified_shape, total_params, valid_targets)
from minituner.planner.shapes import ATTENTION, MLP


def kind_of(name: str) -> str:
    """The planner's module kind of a MiniGPT parameter name (an independent reading of model.py)."""
    if name.startswith("wte."):
        return "token_embedding"
    if name.startswith("wpe."):
        return "position_embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".ln_" in name or name.startswith("ln_f."):
        return "norm"
    kind = "attention" if ".attn." in name else "mlp"
    return kind + ("_bias" if name.endswith(".bias") else "")


def model_counts(cfg: GPTConfig) -> dict[str, int]:
    counts = dict.fromkeys(KINDS, 0)
    for name, p in MiniGPT(cfg).named_parameters():  # a tied lm_head is yielded once, as wte.weight
        counts[kind_of(name)] += p.numel()
    return counts


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_minigpt_default_counts_equal_the_model(bias, tie):
    cfg = GPTConfig(vocab_size=104, block_size=128, bias=bias, tie_weights=tie)
    shape = minigpt_shape(cfg)
    assert param_counts(shape) == model_counts(cfg)
    assert total_params(shape) == sum(p.numel() for p in MiniGPT(cfg).parameters())


@settings(max_examples=25, deadline=None)
@given(
    n_head=st.integers(1, 4), head_size=st.integers(1, 8), n_layer=st.integers(1, 3), vocab=st.integers(1, 50),
    block=st.integers(1, 40), d_ff=st.integers(0, 50), bias=st.booleans(), tie=st.booleans(),
)
def test_random_minigpt_configs_equal_the_model(n_head, head_size, n_layer, vocab, block, d_ff, bias, tie):
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, d_model=n_head * head_size,
                    d_ff=d_ff, bias=bias, tie_weights=tie)
    assert param_counts(minigpt_shape(cfg)) == model_counts(cfg)


def test_the_lab_minigpt_figures():
    shape = minigpt_shape(GPTConfig(vocab_size=104, block_size=128))
    assert block_linear_weights(shape) == 4 * 64 * 64 + 64 * 256 + 256 * 64 == 49_152
    assert lora_trainable_params(shape, 8) == 4 * 9_216  # 9,216 per layer over all six Linears
    attn = [lin for lin in shape.linears if lin.kind == ATTENTION]
    assert Fraction(sum(lora_params(lin, 8) for lin in attn), sum(lin.weight_params for lin in attn)) == Fraction(1, 4)
    assert total_params(shape) == 214_912


@pytest.mark.parametrize("name, h, n_layer, quoted", [
    ("MiniGPT-768", 768, 12, 1.6), ("LLaMA-7B", 4096, 32, 0.30), ("LLaMA-70B", 8192, 80, 0.15),
])
def test_theory02_table(name, h, n_layer, quoted):
    shape, r = simplified_shape(h, n_layer), 8
    assert block_linear_weights(shape) == 12 * h * h
    lora_per_layer = lora_trainable_params(shape, r) // n_layer
    assert lora_per_layer == 18 * r * h
    ratio = Fraction(lora_per_layer, block_linear_weights(shape))
    assert ratio == Fraction(3 * r, 2 * h)  # 18rh / 12h^2 = 1.5 r / h
    assert 100 * float(ratio) == pytest.approx(quoted, rel=0.03)  # Theory 02 rounds 1.56, 0.293, 0.146


@pytest.mark.parametrize("preset, quoted", [("minigpt-768", 1.6), ("llama-7b", 0.30), ("llama-70b", 0.15)])
def test_theory02_ratios_hold_for_the_real_shapes(preset, quoted):
    shape = preset_shape(preset, vocab_size=104)
    ratio = lora_trainable_params(shape, 8) / total_params(shape)
    assert 100 * ratio == pytest.approx(quoted, rel=0.03)


def test_llama_presets_have_the_published_sizes():
    assert total_params(preset_shape("llama-7b")) == 6_738_415_616
    assert total_params(preset_shape("llama-70b")) == 68_976_648_192


def test_linear_4096_to_11008_rank_16_exercise():
    lin = LinearShape("mlp.up_proj", MLP, 4096, 11008, bias=True)
    assert lora_params(lin, 16) == 16 * (4096 + 11008) == 241_664
    assert lin.weight_params == 45_088_768 and lin.bias_params == 11_008
    assert 100 * lora_params(lin, 16) / (lin.weight_params + lin.bias_params) == pytest.approx(0.5358, abs=1e-4)


def test_adapter_checkpoint_sizes_in_fp16():
    # LLaMA-7B, r=8 on q_proj and v_proj: 32 layers x 2 x 8 x (4096 + 4096) = 4,194,304 params = 8 MiB in fp16
    assert adapter_bytes(preset_shape("llama-7b"), 8, "q_proj,v_proj") == 2 * 4_194_304 == 8 * 1024**2
    # MiniGPT, r=8 on all six Linears: 36,864 params = 72 KiB
    assert adapter_bytes(preset_shape("minigpt", 104), 8) == 73_728 == 72 * 1024
    assert adapter_bytes(preset_shape("llama-7b"), 8, "all-linear", bytes_per_param=4) == 4 * 19_988_480


def test_lora_counts_equal_peft_on_minigpt():
    peft = pytest.importorskip("peft")
    cfg = GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, d_model=16, d_ff=24)
    shape = minigpt_shape(cfg)
    for targets in (["q_proj", "v_proj"], ["fc1"], ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]):
        torch.manual_seed(0)
        model = peft.get_peft_model(MiniGPT(cfg), peft.LoraConfig(r=4, target_modules=targets))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_trainable_params(shape, 4, targets) == trainable
        assert total_params(shape) == sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def test_targets_follow_peft_matching():
    shape = minigpt_shape(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, d_model=8))
    assert [lin.path for lin in resolve_targets(shape, "q_proj,v_proj")] == ["attn.q_proj", "attn.v_proj"]
    assert resolve_targets(shape, ["attn.q_proj"]) == resolve_targets(shape, "q_proj")
    assert resolve_targets(shape, "ALL-LINEAR") == shape.linears
    assert valid_targets(shape) == ["all-linear", "fc1", "fc2", "k_proj", "o_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("targets, fragment", [
    ("q_proj,wq", "unknown LoRA target wq"), ("proj", "valid: all-linear, fc1"), ("lm_head", "unknown"),
    ("", "no LoRA target"), (" , ", "no LoRA target"),
])
def test_bad_targets_are_input_errors(targets, fragment):
    shape = minigpt_shape(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, d_model=8))
    with pytest.raises(InputError, match=fragment):
        lora_trainable_params(shape, 8, targets)


@pytest.mark.parametrize("r", [0, -1, 2.0, True, None])
def test_bad_ranks_are_input_errors(r):
    shape = minigpt_shape(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, d_model=8))
    with pytest.raises(InputError, match="positive integer"):
        lora_trainable_params(shape, r)

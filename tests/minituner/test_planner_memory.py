"""Bytes per bucket and regime: the arithmetic the planner promises, checked by hand."""
from fractions import Fraction

import pytest

from minigpt.errors import InputError
from minigpt.model import GPTConfig
from minituner.planner import (MemoryConfig, Regime, default_regimes, korthikanti_activation_bytes,
                               lora_trainable_params, minigpt_shape, nf4_bytes, plan, preset_shape, quantized_params,
                               regime_bytes, seed_activation_bytes, total_params)
from minituner.planner.report import describe, kinds_table, percent, regime_table

LAB = GPTConfig(vocab_size=104, block_size=128)  # the Lab's MiniGPT: d 64, L 4, 214,912 params


@pytest.fixture
def shape():
    return minigpt_shape(LAB)


def test_full_ft_is_16_bytes_per_param_both_ways(shape):
    n = total_params(shape)
    mixed = regime_bytes(shape, Regime("full"))
    assert (mixed.weights, mixed.grads, mixed.optimizer) == (6 * n, 2 * n, 8 * n)  # the seed: fp16 + fp32 master, fp16, m+v
    zero = regime_bytes(shape, Regime("full"), cfg=MemoryConfig(master_copy="optimizer"))
    assert (zero.weights, zero.grads, zero.optimizer) == (2 * n, 2 * n, 12 * n)  # ZeRO: fp16, fp16, fp32 master+m+v
    fp32 = regime_bytes(shape, Regime("full"), cfg=MemoryConfig(full_precision="fp32"))
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4 * n, 4 * n, 8 * n)
    assert mixed.total - mixed.activations == zero.total - zero.activations == fp32.total - fp32.activations == 16 * n


def test_lora_grads_and_adam_only_for_lora_params(shape):
    n, p = total_params(shape), lora_trainable_params(shape, 8)
    b = regime_bytes(shape, Regime("lora", 8))
    assert (b.weights, b.grads, b.optimizer) == (2 * n + 2 * p, 2 * p, 8 * p)
    # frozen parameters never reach the optimizer: a bigger vocabulary changes weights only
    big = minigpt_shape(GPTConfig(vocab_size=5000, block_size=128))
    bb = regime_bytes(big, Regime("lora", 8))
    assert (bb.grads, bb.optimizer) == (b.grads, b.optimizer) and bb.weights > b.weights


def test_qlora_weights_by_hand(shape):
    n, p = total_params(shape), lora_trainable_params(shape, 8)
    quantized = 4 * 49_152  # every block Linear's weight
    b = regime_bytes(shape, Regime("qlora", 8))
    nf4 = Fraction(quantized) * Fraction(9, 16)  # 0.5 byte + 4 bytes / 64 = 0.5625 byte per param
    assert b.weights == nf4 + 2 * (n - quantized) + 2 * p == 220_928
    assert (b.grads, b.optimizer) == (2 * p, 8 * p)


def test_qlora_quantizes_the_targets_by_default(shape):
    n, p = total_params(shape), lora_trainable_params(shape, 8, "q_proj,v_proj")
    qv = regime_bytes(shape, Regime("qlora", 8), "q_proj,v_proj")
    quantized = 4 * 2 * 64 * 64  # q_proj and v_proj of 4 layers; k, o, fc1, fc2 stay fp16
    assert quantized_params(shape, "q_proj,v_proj") == quantized
    assert qv.weights == Fraction(quantized) * Fraction(9, 16) + 2 * (n - quantized) + 2 * p
    # all-linear targets: both readings quantize the same Linears
    assert regime_bytes(shape, Regime("qlora", 8)) == regime_bytes(shape, Regime("qlora", 8),
                                                                   cfg=MemoryConfig(quantize="all-linear"))


def test_qlora_all_linear_quantizes_every_block_linear_whatever_the_targets(shape):
    cfg = MemoryConfig(quantize="all-linear")  # bitsandbytes' load_in_4bit
    all_lin = regime_bytes(shape, Regime("qlora", 8), "all-linear", cfg)
    qv = regime_bytes(shape, Regime("qlora", 8), "q_proj,v_proj", cfg)
    p_all, p_qv = lora_trainable_params(shape, 8), lora_trainable_params(shape, 8, "q_proj,v_proj")
    assert all_lin.weights - 2 * p_all == qv.weights - 2 * p_qv
    assert qv.weights < regime_bytes(shape, Regime("qlora", 8), "q_proj,v_proj").weights


def test_describe_says_which_linears_are_quantized(shape):
    assert "QLoRA: the targeted Linears in NF4" in describe(plan(shape, targets="q_proj"))
    text = describe(plan(shape, targets="q_proj", cfg=MemoryConfig(quantize="all-linear")))
    assert "QLoRA: every block Linear (bitsandbytes load_in_4bit) in NF4" in text


def test_nf4_storage_per_param():
    n = 64 * 256 * 10
    assert Fraction(nf4_bytes(n), n) == Fraction(9, 16)  # 4 bits + fp32 absmax / 64
    overhead_bits = Fraction(8 * nf4_bytes(n, double_quant=True), n) - 4
    assert overhead_bits == Fraction(8, 64) + Fraction(32, 64 * 256)  # QLoRA paper's 0.127 bit
    assert float(overhead_bits) == pytest.approx(0.127, abs=5e-4)
    assert nf4_bytes(65) == 33 + 2 * 4  # a partial block still has its absmax; odd counts round up


def test_double_quant_saves_bytes(shape):
    single = regime_bytes(shape, Regime("qlora", 8)).weights
    double = regime_bytes(shape, Regime("qlora", 8), cfg=MemoryConfig(double_quant=True)).weights
    # per layer: q, k, v, o have 4,096 weights = 64 blocks; fc1, fc2 16,384 = 256 blocks
    fp32_absmax = 4 * (4 * 64) + 2 * (4 * 256)
    int8_absmax = 4 * (64 + 4 * 1) + 2 * (256 + 4 * 1)  # 1 byte per block + an fp32 constant per 256 blocks
    assert single - double == 4 * (fp32_absmax - int8_absmax) == 9_120


def test_activation_estimates(shape):
    assert seed_activation_bytes(shape, 16, 32) == 16 * 32 * 64 * 4 * 16 == 2 * 1024**2
    s, b, h, a, L = 32, 16, 64, 4, 4
    assert korthikanti_activation_bytes(shape, b, s) == L * s * b * h * (34 + Fraction(5 * a * s, h))
    k = regime_bytes(shape, Regime("full"), cfg=MemoryConfig(activations="korthikanti"))
    assert k.activations == 5_767_168


def test_default_regimes_are_the_seeds_five():
    names = [(r.name, r.rank) for r in default_regimes()]
    assert names == [("full", None), ("lora", 4), ("lora", 8), ("lora", 16), ("qlora", 8)]
    assert [(r.name, r.rank) for r in default_regimes([8, 16])] == [
        ("full", None), ("lora", 8), ("lora", 16), ("qlora", 8), ("qlora", 16)]


def test_plan_json_contract(shape):
    d = plan(shape, default_regimes([8])).to_dict()
    assert list(d) == ["model", "total_params", "regimes"]
    assert d["total_params"] == 214_912 and d["model"]["vocab_size"] == 104
    for row in d["regimes"]:
        assert list(row) == ["name", "rank", "trainable_params", "frozen_params", "bytes", "ratio_vs_full"]
        assert list(row["bytes"]) == ["weights", "grads", "optimizer", "activations", "total"]
        assert row["bytes"]["total"] == sum(v for k, v in row["bytes"].items() if k != "total")
        assert all(isinstance(v, int) for v in row["bytes"].values())
        assert row["ratio_vs_full"] == row["trainable_params"] / d["total_params"]
    full, lora, qlora = d["regimes"]
    assert (full["rank"], full["trainable_params"], full["frozen_params"]) == (None, 214_912, 0)
    assert (lora["rank"], lora["trainable_params"], lora["frozen_params"]) == (8, 36_864, 214_912)
    assert qlora["bytes"]["total"] < lora["bytes"]["total"] < full["bytes"]["total"]


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"seq_len": -1}, {"full_precision": "bf16"},
                                    {"activations": "guess"}, {"quantize": "all"}, {"master_copy": "grads"}])
def test_bad_memory_config(kwargs):
    with pytest.raises(InputError):
        MemoryConfig(**kwargs)


@pytest.mark.parametrize("name, rank", [("full", 8), ("lora", 0), ("lora", None), ("adapter", 8)])
def test_bad_regimes(name, rank):
    with pytest.raises(InputError):
        Regime(name, rank)


def test_markdown_tables(shape):
    table = regime_table(plan(shape))
    lines = table.splitlines()
    assert "ratio vs full FT" in lines[0] and "weights MiB" in lines[0]
    assert len(lines) == 2 + 5 and lines[2].startswith("| full FT | 214,912 | 0 | 100% |")
    assert "| LoRA r=8 | 36,864 | 214,912 | 17.2% |" in table
    assert "GiB" in regime_table(plan(preset_shape("llama-7b")))
    assert "| **total** | **214,912** |" in kinds_table(shape)
    assert [percent(x) for x in (1, 0.0015, 0.13)] == ["100%", "0.150%", "13.0%"]

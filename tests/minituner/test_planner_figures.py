"""planner.figures: Lab 01's hand arithmetic, NF4 overheads and the two master-copy conventions."""
from fractions import Fraction

import pytest

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minituner.planner import minigpt_shape, preset_shape, total_params
from minituner.planner.figures import attention_lora_ratio, hand_check, master_copy_split, nf4_overheads

CFG = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, d_model=64)


def test_hand_check_is_the_instantiated_block():
    model, shape = MiniGPT(CFG), minigpt_shape(CFG)
    block = model.blocks[0]
    linears = [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj, block.mlp.fc1, block.mlp.fc2]
    hand = hand_check(shape, 8)
    assert hand["weights"] == sum(m.weight.numel() for m in linears)
    assert hand["lora"] == sum(8 * (m.in_features + m.out_features) for m in linears)
    assert attention_lora_ratio(shape, 8) == Fraction(hand["attn_lora"], hand["attn_w"]) == Fraction(2 * 8, 64)


def test_hand_check_refuses_a_shape_it_does_not_describe():
    with pytest.raises(InputError, match="hand check"):
        hand_check(preset_shape("llama-7b"), 8)  # a SwiGLU MLP (three matrices): not the seed's block


def test_master_copy_moves_4n_between_weights_and_optimizer():
    shape = minigpt_shape(CFG)
    n, split = total_params(shape), master_copy_split(shape)
    seed, zero = split["weights"], split["optimizer"]
    assert (seed["weights"], seed["grads"], seed["optimizer"]) == (6 * n, 2 * n, 8 * n)
    assert (zero["weights"], zero["grads"], zero["optimizer"]) == (2 * n, 2 * n, 12 * n)
    assert seed["total"] == zero["total"]


def test_nf4_overheads():
    o = nf4_overheads(minigpt_shape(CFG))
    q = o["quantized"]
    assert o["fp32_absmax"] == q // 2 + 4 * (q // 64)
    assert o["fp16_scale"] < o["fp32_absmax"] and o["double_quant"] < o["fp32_absmax"]

"""Gradient checkpointing trains the same adapter, keeps only each block's input, and the planner models it."""
from __future__ import annotations

import torch

from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import TrainConfig, train
from minituner.lora import LoRAConfig, apply_lora
from minituner.memory.check import BUCKETS, CheckConfig, memory_check
from minituner.planner import minigpt_shape
from minituner.planner.activations import minigpt_activation_bytes
from minituner.build import wrap_minigpt_qlora

TINY = dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, d_model=16)
# a llama-family Decoder: grouped-query attention, q/k/v biases, tied head (qwen2's layout)
DECODER = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=16, d_ff=24, qkv_bias=True,
               tie_word_embeddings=True)


def lora_after_training(grad_checkpoint: bool, qlora: bool = False, decoder: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(model_type="qwen2", **DECODER)) if decoder else MiniGPT(GPTConfig(**TINY))
    if qlora:
        wrap_minigpt_qlora(model, r=4, alpha=8.0, device="cpu", compute_dtype=torch.float32)
    else:
        apply_lora(model, LoRAConfig(r=4, alpha=8.0))
    ids = torch.randint(40, (400,), generator=torch.Generator().manual_seed(1))
    cfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, eval_batches=1,
                      grad_checkpoint=grad_checkpoint)
    train(model, ids, ids, cfg, block_size=8, progress=False, log=lambda *a: None)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_adapter_equals_the_run_without_checkpointing():
    plain, ckpt = lora_after_training(False), lora_after_training(True)
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:
        assert not torch.equal(plain[name], torch.zeros_like(plain[name]))  # B moved off zero: it trained
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6)


def test_decoder_adapter_equals_the_run_without_checkpointing():
    """The llama family's Decoder: each layer under torch.utils.checkpoint, the same adapter; no new state."""
    plain, ckpt = lora_after_training(False, decoder=True), lora_after_training(True, decoder=True)
    assert plain.keys() == ckpt.keys() and len(plain) == 2 * 7 * 2
    for name in plain:
        assert not torch.equal(plain[name], torch.zeros_like(plain[name]))
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6)
    model = Decoder(DecoderConfig(**DECODER))
    keys = set(model.state_dict())
    model.grad_checkpoint = True
    assert set(model.state_dict()) == keys  # a switch, not a module or a tensor


def test_qlora_adapter_equals_the_run_without_checkpointing():
    plain, ckpt = lora_after_training(False, qlora=True), lora_after_training(True, qlora=True)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6)


def test_checkpointed_buckets_are_exact():
    """Under checkpointing each block keeps its input: the planner's activations equal what is held."""
    cfg = GPTConfig(**{**TINY, "d_model": 64, "n_head": 4})
    for regime, targets in (("full", "all-linear"), ("lora", "v_proj"), ("qlora", "fc1")):
        check = CheckConfig(regime=regime, targets=targets, batch_size=3, seq_len=7, rank=2, grad_checkpoint=True)
        r = memory_check(lambda: MiniGPT(cfg), check, torch.device("cpu"))
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (regime, targets, b, r.predicted[b], r.measured[b])
        without = minigpt_activation_bytes(minigpt_shape(cfg), 3, 7, regime, 2, targets)
        assert r.measured["activations"] < without

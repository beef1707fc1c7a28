"""memory-check on the llama family (minigpt.decoder.Decoder): exact buckets, with and without checkpointing, the peak."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt import cross_entropy, native_attention, native_norm, native_swiglu
from minigpt.decoder import Decoder, DecoderConfig, cpu_flash_takes_gqa
from minigpt.io import write_json
from minituner import native_lora
from minituner.cli import main
from minituner.build import float_dtype
from minituner.memory.check import BUCKETS, CheckConfig, memory_check, predict
from minituner.planner import MemoryConfig, Regime, regime_bytes
from minituner.planner.activations import PRECISION_WIDTHS
from minituner.planner.decoder_activations import decoder_saved_by_layer
from minituner.planner.hf import decoder_shape

CPU = torch.device("cpu")
SRC = str(Path(__file__).resolve().parents[3] / "src")
TINY = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, d_model=32, d_ff=48)
CONFIGS = {  # tied/untied, GQA/MHA, biases, an explicit head_dim, a sliding window shorter than the sequence
    "qwen2 gqa bias tied": dict(model_type="qwen2", n_kv_head=2, qkv_bias=True, tie_word_embeddings=True),
    "llama mha untied": dict(model_type="llama", n_kv_head=4, d_ff=40, vocab_size=60),
    "mistral window head_dim": dict(model_type="mistral", n_kv_head=1, head_dim=16, sliding_window=4,
                                    sliding_layers=[1]),
}
# every branch of the model: the stream hot from the embeddings (full), or cold until the first adapter, which
# sits in attention (v, o) or in the MLP (up: SwiGLU keeps only act(gate); down: only its input), QLoRA's layers
CASES = [("full", "all-linear"), ("lora", "v_proj"), ("lora", "o_proj"), ("lora", "up_proj"), ("qlora", "down_proj"),
         ("qlora", "q_proj,gate_proj")]


def decoder(name: str) -> DecoderConfig:
    return DecoderConfig(**{**TINY, **CONFIGS[name]})


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_buckets_are_exact(name, grad_checkpoint):
    """Weights, grads, Adam state and the bytes saved for backward equal the planner's, byte for byte."""
    cfg = decoder(name)
    for regime, targets in CASES:
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8,
                            grad_checkpoint=grad_checkpoint)
        r = memory_check(lambda: Decoder(cfg), check, CPU, name)
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (name, regime, targets, b, r.predicted[b], r.measured[b])


@pytest.mark.parametrize("name", CONFIGS)
def test_buckets_are_exact_with_fp32_logits_chunked(name, monkeypatch):
    """fp32 logits past minigpt.cross_entropy's FP32_CHUNKED_MIN_VALUES (lowered here): the loss keeps the logits
    and a logsumexp, not F.cross_entropy's log-softmax, and the planner says so byte for byte."""
    monkeypatch.setattr(cross_entropy, "FP32_CHUNKED_MIN_VALUES", 1)
    cfg = decoder(name)
    for regime, targets in CASES:
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8)
        r = memory_check(lambda: Decoder(cfg), check, CPU, name)
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (name, regime, targets, b, r.predicted[b], r.measured[b])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("grad_checkpoint", [False, True])
@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "PyTorch ops"])
def test_bf16_buckets_are_exact(name, grad_checkpoint, native, monkeypatch):
    """--precision bf16 (bf16 block between fp32 norms and stream, bf16 RoPE and mask, the LoRA masters' bf16
    copies; a bf16 base beside fp32 norms and masters): byte for byte too, through minigpt.native_attention and
    minigpt.native_swiglu and minigpt.native_norm, and through SDPA and PyTorch ops (the kernels switched off, as
    on a CPU without a compiler). Slow bf16 allowed for CI CPUs."""
    if native and native_attention.kernels() is None:
        pytest.skip("minigpt.native_attention is not built here (no compiler or no AVX-512)")
    if not native:  # every bf16 kernel of minigpt off
        for module in (native_attention, native_swiglu, native_norm):
            monkeypatch.setattr(module, "kernels", lambda: None)
    cfg = decoder(name)
    for regime, targets in [case for case in CASES if case[0] != "full"]:  # bf16 compute needs a frozen base
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8, precision="bf16",
                            allow_slow_bf16=True, grad_checkpoint=grad_checkpoint)
        r = memory_check(lambda: Decoder(cfg), check, CPU, name)
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (name, regime, targets, b, r.predicted[b], r.measured[b])


def test_terms_follow_the_forward():
    """A few terms by hand: GQA's k/v are saved at their kv heads (enable_gqa where the CPU flash kernel takes
    it; else repeated to h heads), the mask only past the window."""
    cfg = decoder("mistral window head_dim")  # 4 query heads of 16, 1 K/V head, window 4 on layer 1
    shape, N, e = decoder_shape(cfg), 3 * 8, 4
    saved = decoder_saved_by_layer(shape, 3, 8, "lora", 2, "all-linear")
    kv_heads = 1 if cpu_flash_takes_gqa() else 4
    assert saved.blocks[0]["attention q, k, v"] == N * (4 + 2 * kv_heads) * 16 * e
    assert "attention mask" not in saved.blocks[0] and saved.blocks[1]["attention mask"] == 8 * 8 * e
    assert "attention mask" not in decoder_saved_by_layer(shape, 3, 4, "lora", 2).blocks[1]  # T <= window
    assert saved.embed == {"rotary cos/sin": 2 * 8 * 16 * e}
    # LoRA: the frozen embeddings' stream needs no grad until q/k/v's adapters: layer 0's input_layernorm records nothing
    assert saved.blocks[0]["rmsnorm input"] == N * 32 * e and saved.blocks[1]["rmsnorm input"] == 2 * N * 32 * e
    full = decoder_saved_by_layer(shape, 3, 8, "full")
    assert full.embed["token ids"] == N * 8 and full.blocks[0]["rmsnorm normalized input"] == 2 * N * 32 * e
    ckpt = decoder_saved_by_layer(shape, 3, 8, "lora", 2, grad_checkpoint=True)
    assert ckpt.blocks == ({"checkpointed block input": N * 32 * e},) * 2 and ckpt.head == saved.head


def test_bf16_terms_follow_the_dataflow():
    """bf16 compute: RMSNorm saves fp32 (the stream's), RoPE's cos/sin and the window's mask are bf16 (the
    products'), each LoRA layer saves bf16 copies of its masters (not under minituner.native_lora); checkpointing
    keeps the fp32 stream."""
    cfg = decoder("mistral window head_dim")  # C 32, F 48, 4 query heads of 16, 1 K/V head (k/v_proj 32 -> 16)
    shape, N, bf16 = decoder_shape(cfg), 3 * 8, PRECISION_WIDTHS["bf16"]
    fp32, low = (decoder_saved_by_layer(shape, 3, 8, "lora", 2, **w) for w in (PRECISION_WIDTHS["fp32"], bf16))
    assert low.embed == {"rotary cos/sin": 2 * 8 * 16 * 2}
    assert low.blocks[1]["rmsnorm input"] == fp32.blocks[1]["rmsnorm input"] == 2 * N * 32 * 4
    assert low.blocks[1]["rmsnorm rstd"] == 2 * N * 4
    # the window's bf16 mask, unless minigpt.native_attention runs (it applies the window by index)
    assert low.blocks[1].get("attention mask", 0) == (0 if native_attention.takes_bf16_run(8) else 8 * 8 * 2)
    # a CUDA run attends through SDPA: the mask kept, and k, v repeated to the 4 query heads first
    cuda = decoder_saved_by_layer(shape, 3, 8, "lora", 2, on_cpu=False, **bf16)
    assert cuda.blocks[1]["attention mask"] == 8 * 8 * 2 and cuda.blocks[1]["attention q, k, v"] == N * 12 * 16 * 2
    assert 2 * low.blocks[1]["attention q, k, v"] == fp32.blocks[1]["attention q, k, v"]
    # SwiGLU: gate's and up's outputs (48 wide); act(gate) too unless minigpt.native_swiglu recomputes it
    assert low.blocks[1]["silu input"] == low.blocks[1]["up output"] == N * 48 * 2
    assert low.blocks[1].get("silu output", 0) == (0 if native_swiglu.takes_bf16_run() else N * 48 * 2)
    assert cuda.blocks[1]["silu output"] == fp32.blocks[1]["silu output"] // 2 == N * 48 * 2
    # r x (in + out) x bf16 over q (32 -> 64), k and v (32 -> 16), o (64 -> 32), gate and up (32 -> 48), down;
    # none where minituner.native_lora runs the layers (it saves the masters themselves), kept on CUDA
    copies = 2 * (96 + 48 + 48 + 96 + 80 + 80 + 80) * 2
    assert low.blocks[0].get("LoRA factor copies", 0) == (0 if native_lora.takes_bf16_run() else copies)
    assert cuda.blocks[0]["LoRA factor copies"] == copies
    assert "LoRA factor copies" not in fp32.blocks[0]  # fp32 LoRA saves its factors themselves: parameters
    ckpt = decoder_saved_by_layer(shape, 3, 8, "lora", 2, grad_checkpoint=True, **bf16)
    assert ckpt.blocks == ({"checkpointed block input": N * 32 * 4},) * 2 and ckpt.head == low.head


def test_count_defaults_to_the_exact_model_for_the_llama_family():
    shape = decoder_shape(decoder("qwen2 gqa bias tied"))
    exact = regime_bytes(shape, Regime("lora", 8), "all-linear", MemoryConfig(activations="exact"))
    assert exact.peak is not None and exact.activations == decoder_saved_by_layer(
        shape, 16, 32, "lora", 8, act_bytes=2).total()


BF16 = ("--precision", "bf16", "--allow-slow-bf16")


@pytest.mark.parametrize("args,vocab", [((), 2000), (BF16, 2000), ((), 32768), (BF16, 32768)],
                         ids=["fp32", "bf16", "fp32 logits chunked", "bf16 logits kept"])
def test_peak_within_ten_percent_in_a_fresh_process(tmp_path, args, vocab):
    """A small llama (GQA, untied head, ~4M parameters), LoRA at batch 4 x 128 tokens (~66 MiB at the peak; ~43 in
    bf16); benchmarks/memory_sweep.py covers full FT, QLoRA and checkpointing. At a 32,768-token vocabulary the
    fp32 logits (64 MiB) take minigpt.cross_entropy's chunked, in-place path, and the bf16 ones (32 MiB) are kept
    from step to step (precision.keep_head_output): live memory, not the process's own."""
    write_json(tmp_path / "config.json", {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512})
    out = subprocess.run([sys.executable, "-m", "minituner", "memory-check", "--config", str(tmp_path), "--regime", "lora",
                          "--batch-size", "4", "--seq-len", "128", "--device", "cpu", "--json", *args],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": SRC})
    result = json.loads(out.stdout)
    assert abs(result["error"]["peak"]) <= 0.10, result["details"]
    assert result["error"]["activations"] == 0.0


def test_cli_takes_a_llama_family_folder(hf_folder, capsys):
    """--base reads the folder's weights (through hf_load) and the buckets stay exact."""
    pytest.importorskip("transformers")  # the folder is written by transformers' save_pretrained
    folder = hf_folder("mistral", num_key_value_heads=2, tie_word_embeddings=True)
    assert main(["memory-check", "--base", str(folder), "--regime", "qlora", "--rank", "2", "--batch-size", "2",
                 "--seq-len", "8", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(result["error"][b] == 0.0 for b in BUCKETS), result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_16bit_base_in_fp32_is_planned_byte_for_byte(name, dtype):
    """A 16-bit checkpoint trained in fp32, as finetune trains it: its block Linears not quantized stay 16-bit
    (upcast.UpcastLinear) and share QLoRA's workspace, and so do the embedding and head; norms are fp32. Every bucket
    exact."""
    cfg = decoder(name)
    for regime, targets in CASES[1:]:  # full fine-tuning reads the base in fp32
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8)
        r = memory_check(lambda: Decoder(cfg).to(dtype), check, CPU, name)
        assert r.base_dtype == str(dtype).removeprefix("torch.")
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (name, regime, targets, b, r.predicted[b], r.measured[b])
        fp32 = memory_check(lambda: Decoder(cfg), check, CPU, name)
        assert r.predicted["weights"] < fp32.predicted["weights"]  # the 16-bit Linears: 2 bytes a value
        assert r.predicted["activations"] == fp32.predicted["activations"]  # computed in fp32 all the same


def _mixed(cfg: DecoderConfig, fp32_parts: tuple[str, ...]) -> Decoder:
    """A bf16 checkpoint whose named parts (module paths' suffixes) are stored fp32, as a mixed folder loads."""
    model = Decoder(cfg).to(torch.bfloat16)
    for path, m in model.named_modules():
        if path.endswith(fp32_parts):
            m.float()
    return model


@pytest.mark.parametrize("fp32_parts", [("embed_tokens", "lm_head"), ("mlp.down_proj", "self_attn.v_proj"),
                                        ("self_attn.q_proj",)],
                         ids=["fp32 embedding and head", "fp32 down_proj and v_proj", "fp32 q_proj"])
@pytest.mark.parametrize("name", ["llama mha untied", "qwen2 gqa bias tied"])
def test_a_checkpoint_mixing_dtypes_is_planned_part_by_part(name, fp32_parts):
    """Parts stored in different float dtypes are kept as stored (bf16 ones upcast per product, fp32 ones as they
    are): the planner takes each part's dtype (memory.stored_dtypes), and every bucket stays exact, where one dtype
    for the whole base is off by the difference."""
    cfg = decoder(name)
    for regime, targets in CASES[1:]:
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8)
        r = memory_check(lambda: _mixed(cfg, fp32_parts), check, CPU, name)
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (name, fp32_parts, regime, targets, b, r.predicted[b],
                                                     r.measured[b])
        if regime == "lora":  # every part kept as stored (QLoRA may quantize the fp32 ones)
            one_dtype = predict(cfg, check, name, base_dtype=getattr(torch, r.base_dtype))[0]
            assert one_dtype["weights"] != r.measured["weights"]


def test_stored_dtypes_names_every_part_of_a_folder_and_a_model(hf_folder, capsys):
    """The folder's headers and the loaded model give the same parts and dtypes (a tied head is the embedding's), and
    count --base plans the run memory-check measures."""
    from safetensors.torch import load_file, save_file

    from minituner.base_model import load_base, stored_part_dtypes
    from minituner.memory.stored_dtypes import stored_dtypes

    folder = hf_folder("qwen2", name="qwen2-mixed", dtype=torch.bfloat16, tie_word_embeddings=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].float()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    parts = stored_part_dtypes(folder)
    assert parts["token_embedding"] == parts["lm_head"] == torch.float32
    assert {parts[p] for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")} == {torch.bfloat16}
    assert not any("norm" in p for p in parts)
    model = load_base(folder)[0]
    assert stored_dtypes((n, p.dtype, p.numel()) for n, p in model.named_parameters()) == parts
    window = ["--rank", "2", "--batch-size", "2", "--seq-len", "8", "--target", "q_proj,v_proj"]
    assert main(["count", "--base", str(folder), *window, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["finetune_cpu"]
    assert run["stored_dtypes"]["token_embedding"] == "float32"
    lora = run["regimes"][1]
    assert main(["memory-check", "--base", str(folder), "--regime", "lora", *window, "--steps", "1", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert lora["weights"] == checked["predicted"]["weights"] == checked["measured"]["weights"]
    assert main(["count", "--base", str(folder), *window]) == 0
    assert "a checkpoint mixing float dtypes" in capsys.readouterr().out


def test_a_tied_folders_stored_head_is_not_counted_twice(hf_folder):
    """A tied config with an lm_head.weight stored anyway (equal to the embedding, in another dtype): load_base
    keeps the embedding alone, and so do stored_dtype and stored_part_dtypes."""
    from safetensors.torch import load_file, save_file

    from minituner.base_model import load_base, stored_dtype, stored_part_dtypes

    folder = hf_folder("qwen2", name="qwen2-stored-tied-head", dtype=torch.bfloat16, tie_word_embeddings=True,
                       vocab_size=2000)
    weights = load_file(folder / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embedding.float()  # the same values, stored fp32
    weights["lm_head.weight"] = embedding.clone()  # and the head stored too, bf16
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_base(folder)[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert stored_dtype(folder) == float_dtype(model) == torch.float32  # 64,000 fp32 values against ~15,000 bf16
    assert stored_part_dtypes(folder)["lm_head"] == torch.float32

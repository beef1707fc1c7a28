"""memory-check: the planner's buckets equal the measured ones exactly on tiny models (fp32 and bf16, CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt import native_attention
from minigpt.base_folder import save_base
from minigpt.io import write_json
from minigpt.model import GPTConfig, MiniGPT
from minituner import native_lora
from minituner.cli import main
from minituner.hf_gpt2 import gpt2_config_dict
from minituner.memory.check import BUCKETS, CheckConfig, SavedTensors, describe, memory_check
from minituner.planner import MemoryConfig, Regime, minigpt_shape, regime_bytes, total_params
from minituner.planner.activations import PRECISION_WIDTHS, minigpt_activation_terms, minigpt_saved_by_layer

CPU = torch.device("cpu")
SRC = str(Path(__file__).resolve().parents[3] / "src")  # the checkout's src, not an installed copy
TINY = dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, d_model=16)


def check(cfg: GPTConfig, **kw):
    return memory_check(lambda: MiniGPT(cfg), CheckConfig(batch_size=3, seq_len=7, rank=2, **kw), CPU)


@pytest.mark.parametrize("cfg", [GPTConfig(**TINY),
                                 GPTConfig(**{**TINY, "n_layer": 3, "bias": False, "tie_weights": False, "d_ff": 24})])
@pytest.mark.parametrize("regime,targets", [("full", "all-linear"), ("lora", "all-linear"), ("lora", "q_proj,v_proj"),
                                            ("lora", "k_proj"), ("lora", "o_proj,fc1"), ("lora", "fc2")])
def test_buckets_are_exact(cfg, regime, targets):
    r = check(cfg, regime=regime, targets=targets)
    for b in BUCKETS:
        assert r.predicted[b] == r.measured[b], (b, r.predicted[b], r.measured[b])
    assert r.measured["activations"] > 0 and r.measured["weights"] > 0
    # full FT: weights and grads are 4 bytes per parameter, Adam 8 (tied lm_head counted once)
    if regime == "full":
        n = total_params(minigpt_shape(cfg))
        assert (r.measured["weights"], r.measured["grads"], r.measured["optimizer"]) == (4 * n, 4 * n, 8 * n)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj,fc1"])
def test_qlora_buckets_are_exact(targets):
    r = check(GPTConfig(**{**TINY, "d_model": 64, "n_head": 4}), regime="qlora", targets=targets)
    for b in BUCKETS:
        assert r.predicted[b] == r.measured[b], (b, r.predicted[b], r.measured[b])


def test_activation_terms_follow_the_regime():
    shape = minigpt_shape(GPTConfig(**TINY))
    full = minigpt_activation_terms(shape, 2, 8, "full")
    lora = minigpt_activation_terms(shape, 2, 8, "lora", 4, "all-linear")
    assert "token/position ids" in full and "token/position ids" not in lora  # frozen embeddings record nothing
    assert lora["LoRA A output"] == 2 * 6 * 2 * 8 * 4 * 4  # layers x Linears x N x r x 4 bytes
    # block 0's ln_1 sees no grad-requiring input under LoRA: one layernorm input fewer than full FT
    assert full["layernorm input"] - lora["layernorm input"] == 2 * 8 * 16 * 4
    assert full["log-softmax output"] == 2 * 8 * 40 * 4


def test_bf16_terms_follow_the_dataflow():
    """bf16 compute: norms save fp32 (they read the fp32 stream), the block between them saves bf16, and each
    LoRA layer saves the bf16 copies of its fp32 masters, unless minituner.native_lora runs it (an even rank, no
    LoRA dropout, its kernels built here), which saves the masters themselves."""
    shape, N, r = minigpt_shape(GPTConfig(**TINY)), 2 * 8, 4
    fp32 = minigpt_saved_by_layer(shape, 2, 8, "lora", r).terms()
    bf16 = minigpt_saved_by_layer(shape, 2, 8, "lora", r, **PRECISION_WIDTHS["bf16"]).terms()
    for term in ("layernorm input", "layernorm mean/rstd", "targets"):
        assert bf16[term] == fp32[term]
    # the loss keeps the bf16 logits and one fp32 logsumexp per token, not an fp32 log-softmax
    assert "log-softmax output" not in bf16 and fp32["log-softmax output"] == N * 40 * 4
    assert bf16["logits kept by the loss"] == N * 40 * 2 and bf16["loss logsumexp"] == N * 4
    for term in ("LoRA A output", "attention q, k, v", "gelu input"):
        assert 2 * bf16[term] == fp32[term]
    # the attention output: kept by the fused kernel, or (minigpt.native_attention) by o_proj's LoRA A instead
    native = native_attention.takes_bf16_run(8)
    assert 2 * bf16.get("attention output", 0) == (0 if native else fp32["attention output"])
    assert 2 * bf16["linear input"] == fp32["linear input"] + (fp32["attention output"] if native else 0)
    # and at 8 tokens (h·T = 16 <= 3·C = 48) it keeps its bf16 probabilities (B, h, T, T) instead of the logsumexp
    assert bf16.get("attention probabilities kept", 0) == (2 * 2 * 2 * 8 * 8 * 2 if native else 0)  # 2 layers
    assert bf16.get("attention logsumexp", 0) == (0 if native else fp32["attention logsumexp"])
    assert "attention probabilities kept" not in fp32
    longer = minigpt_shape(GPTConfig(**{**TINY, "block_size": 32}))  # 32 tokens: h·T = 64 > 48, recomputed
    terms = minigpt_saved_by_layer(longer, 1, 32, "lora", r, **PRECISION_WIDTHS["bf16"]).terms()
    assert "attention probabilities kept" not in terms and terms["attention logsumexp"] == 2 * 2 * 32 * 4
    # a plain 16-bit plan (MemoryConfig(dtype="fp16"), no fp32 stream) is not that path: SDPA keeps the output
    plain = minigpt_saved_by_layer(shape, 2, 8, "lora", r, act_bytes=2).terms()
    assert 2 * plain["attention output"] == fp32["attention output"]
    cuda = minigpt_saved_by_layer(shape, 2, 8, "lora", r, on_cpu=False, **PRECISION_WIDTHS["bf16"]).terms()
    assert 2 * cuda["attention output"] == fp32["attention output"]  # a CUDA run attends through SDPA
    assert "LoRA factor copies" not in fp32  # fp32 LoRA saves its factors themselves: parameters
    copies = 2 * r * (4 * (16 + 16) + 2 * (16 + 64)) * 2  # layers x r(in + out) x bf16
    assert bf16.get("LoRA factor copies", 0) == (0 if native_lora.takes_bf16_run() else copies)
    for odd_or_dropout in ({"rank": 3}, {"lora_dropout": 0.1}):  # the PyTorch path: LoRAUpdate saves the copies
        kw = {"rank": r, **odd_or_dropout}
        terms = minigpt_saved_by_layer(shape, 2, 8, "lora", **kw, **PRECISION_WIDTHS["bf16"]).terms()
        assert terms["LoRA factor copies"] == copies * kw["rank"] // r
    ckpt = minigpt_saved_by_layer(shape, 2, 8, "lora", r, grad_checkpoint=True, **PRECISION_WIDTHS["bf16"])
    assert ckpt.blocks == ({"checkpointed block input": N * 16 * 4},) * 2  # the fp32 stream


def test_planner_dtype_scales_lora_buckets():
    shape, regime = minigpt_shape(GPTConfig(**TINY)), Regime("lora", 2)
    fp16 = regime_bytes(shape, regime, cfg=MemoryConfig())
    fp32 = regime_bytes(shape, regime, cfg=MemoryConfig(dtype="fp32"))
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (2 * fp16.weights, 2 * fp16.grads, fp16.optimizer)


def test_saved_tensors_count_each_storage_once():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with SavedTensors(model) as saved:
        y = model(x)  # saves x (and the weight, a parameter: excluded)
        z = (y * y).sum()  # saves y twice: one storage
        (y.exp() > 0).all()  # exp saves its output, freed with the temporary: not counted
    assert saved.bytes == x.numel() * 4 + y.numel() * 4
    z.backward()


def test_cli_gpt2_config_json(tmp_path, capsys):
    d = gpt2_config_dict(GPTConfig(**{**TINY, "activation": "gelu_tanh"}))
    write_json(tmp_path / "config.json", d)
    assert main(["memory-check", "--config", str(tmp_path), "--regime", "full", "--batch-size", "2",
                 "--seq-len", "8", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"predicted", "measured", "error", "details"}
    for key in ("predicted", "measured", "error"):
        assert list(out[key]) == ["weights", "grads", "optimizer", "activations", "peak"]
    for b in BUCKETS:
        assert out["error"][b] == 0.0 and out["measured"][b] > 0 and out["predicted"][b] == out["measured"][b]
    p, m = out["predicted"]["peak"], out["measured"]["peak"]
    assert isinstance(p, int) and isinstance(m, int) and out["error"]["peak"] == pytest.approx((p - m) / m)
    assert out["details"]["trainable_params"] == out["details"]["params"]
    assert out["details"]["measured_peak_phase"] in ("forward", "backward", "optimizer step")
    assert main(["memory-check", "--config", str(tmp_path), "--regime", "full", "--rank", "4", "--batch-size", "2",
                 "--seq-len", "8", "--device", "cpu", "--json"]) == 0  # a rank is not dropped without a word
    assert "note: --rank applies to --regime lora and qlora" in capsys.readouterr().err


def test_cli_base_folder_and_table(tmp_path, capsys):
    save_base(MiniGPT(GPTConfig(**TINY)), None, tmp_path / "base")
    assert main(["memory-check", "--base", str(tmp_path / "base"), "--target", "q_proj", "--rank", "2",
                 "--batch-size", "2", "--seq-len", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| activations | " in out and "seed estimate" in out and "| peak (planner/peak.py) |" in out


@pytest.mark.parametrize("pinned", [True, False])
def test_the_baseline_is_taken_with_the_heap_trimmed_when_pinned(monkeypatch, pinned):
    """With glibc's threshold pinned, the heap's free pages go back before the process's own memory is read (the
    free small blocks the first step left would otherwise count as the process's and hide the next step's); left
    as it is, the heap is not touched (that run measures what glibc keeps)."""
    from minituner.memory import check as check_module

    calls = []
    monkeypatch.setattr(check_module, "pin_allocator", lambda threshold: True)
    monkeypatch.setattr(check_module, "trim_heap", lambda: calls.append(1) or True)
    r = check(GPTConfig(**TINY), regime="lora", pin_allocator=pinned, steps=3)
    assert len(calls) == (1 if pinned else 0)  # once, before the first measured step
    assert r.predicted["activations"] == r.measured["activations"]


@pytest.mark.parametrize("args", [("--regime", "lora"), ("--regime", "full", "--grad-checkpoint"),
                                  ("--regime", "full", "--grad-accum", "2"), ("--regime", "qlora", "--grad-accum", "3"),
                                  ("--regime", "lora", "--grad-checkpoint", "--precision", "bf16", "--allow-slow-bf16")])
def test_peak_within_ten_percent_in_a_fresh_process(tmp_path, args):
    """The planner's step peak against the measured one, in a process of its own (its peak is this run's alone).

    MiniGPT at d_model 64 with batch 16 x 128 tokens (~35 MiB at the peak): at tiny sizes (a few MiB) the
    libraries' and allocator's own growth during a step is of the order of the whole peak; here it is not."""
    write_json(tmp_path / "config.json", {"model_type": "minigpt", "vocab_size": 104, "block_size": 128})
    out = subprocess.run([sys.executable, "-m", "minituner", "memory-check", "--config", str(tmp_path), *args,
                          "--batch-size", "16", "--seq-len", "128", "--device", "cpu", "--json"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": SRC})
    result = json.loads(out.stdout)
    assert abs(result["error"]["peak"]) <= 0.10, result["details"]
    assert result["error"]["activations"] == 0.0


@pytest.mark.parametrize("tied,accum,library", [(True, 1, "auto"), (False, 1, "auto"), (True, 2, "auto"),
                                                (False, 2, "auto"), (True, 1, "aten"), (True, 1, "onednn")])
def test_a_large_vocabulary_full_ft_peaks_as_planned_at_the_embeddings(tmp_path, tied, accum, library):
    """V x C (50,000 x 512) dwarfs the rest: the embeddings' backward (tied, or accumulating) is the step's peak.
    Checked closely (3%), since that phase was once over-counted by a whole V x C gradient, hidden while
    AdamW's single-tensor temporaries (2 x V x C) made the optimizer step as large; and on both fp32 libraries
    (minikernels.fp32_gemm), since F.linear's view gradient once made it a V x C larger where aten ran."""
    write_json(tmp_path / "config.json", {"model_type": "minigpt", "vocab_size": 50_000, "block_size": 64,
                                          "d_model": 512, "n_layer": 1, "n_head": 8, "tie_weights": tied})
    out = subprocess.run([sys.executable, "-m", "minituner", "memory-check", "--config", str(tmp_path),
                          "--regime", "full", "--grad-accum", str(accum), "--batch-size", "1", "--seq-len", "64",
                          "--device", "cpu", "--json"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": SRC, "MINIKERNELS_FP32_GEMM": library})
    result = json.loads(out.stdout)
    assert abs(result["error"]["peak"]) <= 0.03, result["details"]


def test_cli_refuses_what_it_cannot_build(tmp_path, capsys):
    write_json(tmp_path / "config.json", {"model_type": "falcon", "hidden_size": 16})
    assert main(["memory-check", "--config", str(tmp_path), "--device", "cpu"]) == 2
    assert "'falcon' is not supported" in capsys.readouterr().err
    assert main(["memory-check", "--seq-len", "9999", "--device", "cpu"]) == 2
    assert "block_size" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_buckets(precision):
    cfg = GPTConfig(**{**TINY, "d_model": 64, "n_head": 4})
    r = memory_check(lambda: MiniGPT(cfg).cuda(), CheckConfig(regime="lora", batch_size=2, seq_len=8,
                                                              precision=precision), torch.device("cuda"))
    for b in ("weights", "grads", "optimizer"):  # the LoRA masters' grads and Adam are fp32 in both
        assert r.predicted[b] == r.measured[b]
    assert r.measured["peak"] >= r.measured["weights"] and r.peak_source.startswith("torch.cuda")
    if precision == "fp32":
        assert abs(r.predicted["activations"] - r.measured["activations"]) <= 0.1 * r.measured["activations"]


@pytest.mark.parametrize("cfg", [GPTConfig(**TINY),
                                 GPTConfig(**{**TINY, "bias": False, "tie_weights": False, "d_ff": 24})])
@pytest.mark.parametrize("regime,targets", [("lora", "all-linear"), ("lora", "k_proj"), ("lora", "o_proj,fc1"),
                                            ("qlora", "all-linear"), ("qlora", "fc2")])
@pytest.mark.parametrize("grad_checkpoint", [False, True])
@pytest.mark.parametrize("native", [True, False], ids=["native attention", "SDPA"])
def test_bf16_buckets_are_exact(cfg, regime, targets, grad_checkpoint, native, monkeypatch):
    """--precision bf16 (slow bf16 allowed: CI CPUs may lack bf16 units): a bf16 base beside fp32 norms and LoRA
    masters, the bf16 block between the fp32 norms and stream, the masters' bf16 copies: every bucket exact,
    through minigpt.native_attention and through SDPA (its kernels switched off)."""
    if native and native_attention.kernels() is None:
        pytest.skip("minigpt.native_attention is not built here (no compiler or no AVX-512)")
    if not native:
        monkeypatch.setattr(native_attention, "kernels", lambda: None)
    r = check(cfg, regime=regime, targets=targets, precision="bf16", allow_slow_bf16=True,
              grad_checkpoint=grad_checkpoint)
    for b in BUCKETS:
        assert r.predicted[b] == r.measured[b], (b, r.predicted[b], r.measured[b])


@pytest.mark.parametrize("regime", ["lora", "qlora"])
def test_bf16_frozen_base_is_planned_in_bf16(regime):
    """--precision bf16: the base in bf16, LoRA and Adam fp32; the block's activations in bf16."""
    cfg = GPTConfig(**{**TINY, "d_model": 64, "n_head": 4})
    fp32, bf16 = (memory_check(lambda: MiniGPT(cfg), CheckConfig(regime=regime, batch_size=2, seq_len=8, precision=p,
                                                                 allow_slow_bf16=True), CPU) for p in ("fp32", "bf16"))
    assert bf16.predicted["weights"] == bf16.measured["weights"] < fp32.measured["weights"]
    for b in ("grads", "optimizer"):
        assert bf16.predicted[b] == bf16.measured[b] == fp32.measured[b]
    assert bf16.predicted["activations"] == bf16.measured["activations"] < fp32.measured["activations"]
    assert bf16.to_json()["details"]["precision"] == "bf16"


def test_bf16_is_refused_on_a_cpu_without_bf16_units(monkeypatch, capsys):
    monkeypatch.setattr("minigpt.bf16_support.cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert main(["memory-check", "--precision", "bf16", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no bf16 units" in err and "--allow-slow-bf16" in err and len(err.strip().splitlines()) == 1


def test_batch_of_one_is_exact():
    """A (1, T) slice is 'contiguous' yet shares its window's storage: memory-check feeds its own storages."""
    cfg = GPTConfig(**TINY)
    r = memory_check(lambda: MiniGPT(cfg), CheckConfig(batch_size=1, seq_len=5, rank=2), CPU)
    assert r.predicted["activations"] == r.measured["activations"]


def test_parameters_are_counted_by_element_in_every_regime():
    """A quantized weight is a buffer, not an nn.Parameter: it still counts, as the planner counts it."""
    cfg = GPTConfig(**TINY)
    n = total_params(minigpt_shape(cfg))
    for regime in ("full", "lora", "qlora"):
        r = check(cfg, regime=regime)
        assert r.params == n, (regime, r.params, n)
        assert f"{n:,} base parameters" in describe(r)

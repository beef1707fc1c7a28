"""Planning a batch whose targets partly count (instruction data): the head and the loss run on the counted rows
(minigpt.train.counted_logits), and the planner follows them, checked against memory-check's measurements."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigpt.decoder import Decoder, DecoderConfig
from minigpt.errors import InputError
from minigpt.io import write_json
from minigpt.model import GPTConfig, MiniGPT
from minituner.cli import main
from minituner.finetune import default_train_config
from minituner.memory.check import BUCKETS, CheckConfig, memory_check, predict
from minituner.planner import MemoryConfig, Regime, minigpt_shape, regime_bytes
from minituner.planner.activations import minigpt_saved_by_layer
from minituner.planner.decoder_activations import decoder_saved_by_layer
from minituner.planner.hf import decoder_shape
from minituner.sft import Example, ExampleSampler, largest_batch

CPU = torch.device("cpu")
SRC = str(Path(__file__).resolve().parents[3] / "src")
DECODERS = {
    "qwen2 gqa bias tied": DecoderConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, d_model=32, d_ff=48,
                                         model_type="qwen2", n_kv_head=2, qkv_bias=True, tie_word_embeddings=True),
    "mistral window untied": DecoderConfig(vocab_size=60, block_size=32, n_layer=2, n_head=4, d_model=32, d_ff=40,
                                           model_type="mistral", n_kv_head=1, head_dim=16, sliding_window=4,
                                           sliding_layers=[1]),
}
CASES = [("full", "all-linear"), ("lora", "v_proj"), ("lora", "up_proj"), ("qlora", "q_proj,gate_proj")]


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_decoder_buckets_are_exact_with_counted_targets(name, grad_checkpoint):
    """One, some and all but one of 24 targets counting: every bucket byte for byte, every regime."""
    for regime, targets in CASES:
        for counted in (1, 7, 23):
            check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=8,
                                grad_checkpoint=grad_checkpoint, counted_targets=counted)
            r = memory_check(lambda: Decoder(DECODERS[name]), check, CPU, name)
            for b in BUCKETS:
                assert r.predicted[b] == r.measured[b], (regime, targets, counted, b, r.predicted[b], r.measured[b])


@pytest.mark.parametrize("regime,targets", [("full", "all-linear"), ("lora", "q_proj"), ("lora", "fc2"),
                                            ("qlora", "all-linear")])
def test_minigpt_buckets_are_exact_with_counted_targets(regime, targets):
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, d_model=32)
    for counted in (1, 20, 47):
        check = CheckConfig(regime=regime, targets=targets, rank=2, batch_size=3, seq_len=16, counted_targets=counted)
        r = memory_check(lambda: MiniGPT(cfg), check, CPU, "minigpt")
        for b in BUCKETS:
            assert r.predicted[b] == r.measured[b], (counted, b, r.predicted[b], r.measured[b])


def test_counted_rows_shrink_the_loss_and_head_terms():
    """By hand: the loss keeps n rows of log-softmax and targets, the selection its (B, T) bool mask, a head that
    trains its n input rows; everything before the head is unchanged. All N counted equals the default."""
    shape = minigpt_shape(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, d_model=32))
    N, n, V, C = 3 * 16, 20, 50, 32
    every, some = (minigpt_saved_by_layer(shape, 3, 16, "full", counted=c) for c in (None, n))
    assert every == minigpt_saved_by_layer(shape, 3, 16, "full", counted=N)
    assert some.blocks == every.blocks and some.embed == every.embed
    assert some.head["log-softmax output"] == n * V * 4 and every.head["log-softmax output"] == N * V * 4
    assert some.head["targets"] == n * 8 and some.head["counted-rows mask"] == N
    assert some.head["linear input"] == n * C * 4 and every.head["linear input"] == N * C * 4
    assert "counted-rows mask" not in every.head
    dec = decoder_shape(DECODERS["qwen2 gqa bias tied"])
    low = decoder_saved_by_layer(dec, 3, 8, "lora", 2, act_bytes=2, stream_bytes=4, lora_copy_bytes=2, counted=5)
    assert low.head["logits kept by the loss"] == 5 * 50 * 2 and low.head["loss logsumexp"] == 5 * 4


def test_counted_targets_must_fit_the_batch():
    for bad in (0, 49, True, 2.0):
        with pytest.raises(InputError, match="counted targets must be an integer from 1 to the batch's 48 positions"):
            MemoryConfig(batch_size=3, seq_len=16, activations="exact", counted_targets=bad)
    with pytest.raises(InputError, match="needs the exact activation model"):
        MemoryConfig(batch_size=3, seq_len=16, activations="seed", counted_targets=4)
    with pytest.raises(InputError, match="from 1 to the batch's 24 positions"):
        CheckConfig(batch_size=3, seq_len=8, counted_targets=25).validate(32)


def test_fewer_counted_targets_plan_a_smaller_peak():
    shape = decoder_shape(DECODERS["qwen2 gqa bias tied"])
    peaks = [regime_bytes(shape, Regime("lora", 8), "all-linear",
                          MemoryConfig(batch_size=4, seq_len=32, activations="exact", counted_targets=c)).peak
             for c in (1, 32, 64, 128)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    every = MemoryConfig(batch_size=4, seq_len=32, activations="exact")
    assert regime_bytes(shape, Regime("lora", 8), "all-linear", every).peak < peaks[-1] + 128  # + the N-byte mask


def test_peak_within_ten_percent_with_a_quarter_counted(tmp_path):
    """A small llama with a 32,000-token vocabulary, LoRA at 4 x 128 tokens, a quarter of the targets counting:
    the loss's (N, V) terms are most of the peak, so planning every position would be far off; planning the
    counted rows is within 10% (about 0.3% measured when written)."""
    write_json(tmp_path / "config.json", {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512})
    out = subprocess.run([sys.executable, "-m", "minituner", "memory-check", "--config", str(tmp_path), "--regime",
                          "lora", "--batch-size", "4", "--seq-len", "128", "--counted-targets", "128", "--device", "cpu",
                          "--json"], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": SRC})
    result = json.loads(out.stdout)
    assert result["details"]["counted_targets"] == 128
    assert abs(result["error"]["peak"]) <= 0.10, result["details"]
    assert result["error"]["activations"] == 0.0
    cfg = DecoderConfig(vocab_size=32000, block_size=512, n_layer=4, n_head=8, d_model=256, d_ff=688, n_kv_head=2)
    every, _, _, _ = predict(cfg, CheckConfig(regime="lora", batch_size=4, seq_len=128))
    assert every["peak"] > 1.5 * result["measured"]["peak"]  # what planning every position would have said


def _example(length: int, counted: int) -> Example:
    labels = [-100] * (length - counted) + list(range(counted))  # a prompt, then the answer
    return Example(list(range(length)), labels)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 30), st.integers(1, 29)), min_size=1, max_size=12), st.integers(1, 6),
       st.integers(0, 2**16))
def test_no_drawn_batch_exceeds_the_largest_batch(shapes, batch_size, seed):
    examples = [_example(length, min(counted, length - 1)) for length, counted in shapes]
    largest = largest_batch(examples, batch_size)
    assert largest.seq_len == max(len(e.input_ids) for e in examples) - 1
    assert largest.counted == batch_size * max(e.counted for e in examples)
    sampler, g = ExampleSampler(examples), torch.Generator().manual_seed(seed)
    for _ in range(10):
        x, y = sampler(batch_size, g)
        assert x.shape[1] <= largest.seq_len and int((y != -100).sum()) <= largest.counted
    solo = ExampleSampler([max(examples, key=lambda e: e.counted)])(batch_size, g)[1]
    assert int((solo != -100).sum()) == largest.counted  # reached when one example fills the batch


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_count_plans_the_largest_batch_of_the_data(hf_folder, tmp_path, capsys):
    """count --base --data: the window, the longest example and the most-counted one, read as finetune reads them;
    its CPU run is memory-check's prediction at that batch."""
    folder = hf_folder("llama")
    records = [{"prompt": "the wind is " * k, "completion": "calm rain later " * (1 + k % 3)} for k in range(1, 12)]
    data = _jsonl(tmp_path / "d.jsonl", records)
    assert main(["count", "--base", str(folder), "--data", str(data), "--batch-size", "2", "--rank", "4",
                 "--seq-len", "40", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    from minituner.base_model import base_tokenizer
    from minituner.sft import load_chat_template, prepare_sft
    sft = prepare_sft(data, base_tokenizer(folder), load_chat_template(folder), 40)
    expected = largest_batch([*sft.train, *sft.val], 2)  # evaluation batches the val split at the same size
    assert plan["data"] == {"source": str(data), "batch_size": 2, "seq_len": expected.seq_len,
                            "counted": expected.counted, "mean_counted": expected.mean_counted}
    assert expected.seq_len == 40 and expected.counted < 2 * 40  # the longest is cut at the window; answers count
    assert plan["batch"] == {"batch_size": 2, "seq_len": 40, "counted_targets": expected.counted, "grad_accum": 1}
    run = plan["finetune_cpu"]
    assert run["counted_targets"] == expected.counted
    check = CheckConfig(regime="lora", rank=4, batch_size=2, seq_len=40, counted_targets=expected.counted)
    from minituner.base_model import model_config
    predicted, *_ = predict(model_config(folder), check)
    lora = next(r for r in run["regimes"] if r["regime"].startswith("LoRA"))
    assert lora["peak"] == predicted["peak"] and lora["activations"] == predicted["activations"]
    assert main(["count", "--base", str(folder), "--data", str(data), "--batch-size", "2", "--rank", "4",
                 "--seq-len", "40", "--train-on-inputs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["counted"] > expected.counted  # prompts count too
    text = tmp_path / "t.txt"
    text.write_text("the wind is calm rain later\n\n" * 50)
    assert main(["count", "--base", str(folder), "--data", str(text), "--batch-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] == {"batch_size": 2, "seq_len": 64, "counted_targets": 128,
                                                            "grad_accum": 1}
    assert main(["count", "--base", str(folder), "--data", str(text), "--json"]) == 0  # finetune's batch size
    assert json.loads(capsys.readouterr().out)["batch"]["batch_size"] == default_train_config().batch_size


def test_count_data_notes_what_finetune_would_refuse(hf_folder, tmp_path, capsys):
    """Text the folder's tokenizer cannot read is planned, with finetune's refusal as a note on stderr."""
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "the gale is", "completion": "calm"}] * 30)
    assert main(["count", "--base", str(hf_folder("llama")), "--data", str(data), "--rank", "4"]) == 0
    captured = capsys.readouterr()
    assert "planned at the largest batch finetune makes" in captured.out
    assert captured.err.startswith("note: finetune would refuse this data: ") and "'gale'" in captured.err


def test_evaluation_splits_a_batch_whose_logits_are_large(monkeypatch):
    """Evaluation runs a few rows at a time past EVAL_LOGITS_BYTES: the same loss, windows and examples alike."""
    import minigpt.train as train
    from minituner.sft import evaluate_examples

    model = MiniGPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, d_model=16))
    ids = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0))
    examples = [_example(length, 1 + length // 3) for length in (5, 9, 17, 12, 8)]
    whole = train.evaluate(model, ids, 16, batch_size=8, max_batches=3), evaluate_examples(model, examples, 4).loss
    assert len(train.eval_rows(torch.zeros(8, 16), torch.zeros(8, 16), 50)) == 1
    monkeypatch.setattr(train, "EVAL_LOGITS_BYTES", 3 * 16 * 50 * 4)  # three rows of 16 positions at a time
    assert [len(x) for x, _ in train.eval_rows(torch.zeros(8, 16), torch.zeros(8, 16), 50)] == [3, 3, 2]
    split = train.evaluate(model, ids, 16, batch_size=8, max_batches=3), evaluate_examples(model, examples, 4).loss
    assert split == pytest.approx(whole, rel=1e-6)


@pytest.mark.parametrize("args,message", [
    (["--data", "{data}"], "--data needs --base"),
    (["--base", "{folder}", "--data", "{data}", "--counted-targets", "3"], "both say how many targets count"),
    (["--base", "{folder}", "--overlong", "drop"], "apply to --data"),
    (["--base", "{folder}", "--counted-targets", "999999"], "from 1 to the batch's"),
    (["--base", "{folder}", "--counted-targets", "5", "--activations", "seed"],
     "--counted-targets needs --activations exact"),
    (["--base", "{folder}", "--data", "{tmp}/missing.jsonl"], "not found"),
])
def test_count_refuses_bad_counted_flags(hf_folder, tmp_path, capsys, args, message):
    folder = hf_folder("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "the wind", "completion": "calm"}] * 30)
    args = [a.format(folder=folder, data=data, tmp=tmp_path) for a in args]
    assert main(["count", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_memory_check_cli_takes_counted_targets(capsys):
    assert main(["memory-check", "--regime", "lora", "--batch-size", "2", "--seq-len", "16", "--counted-targets", "5",
                 "--device", "cpu"]) == 0
    assert "with 5 of its 32 targets counted" in capsys.readouterr().out
    assert main(["memory-check", "--batch-size", "2", "--seq-len", "16", "--counted-targets", "33", "--device",
                 "cpu"]) == 2
    assert "from 1 to the batch's 32 positions" in capsys.readouterr().err


def test_finetune_logs_and_keeps_the_plan_of_its_largest_batch(hf_folder, tmp_path, capsys):
    """finetune plans its run before it trains: memory-check's prediction at the largest batch of its
    data (count --base --data shows the same), logged and written to manifest.json."""
    folder = hf_folder("llama")
    records = [{"prompt": "the wind is " * (1 + k % 4), "completion": "calm rain later " * (1 + k % 3)}
               for k in range(24)]
    data = _jsonl(tmp_path / "d.jsonl", records)
    args = ["--base", str(folder), "--data", str(data), "--batch-size", "3", "--seq-len", "32", "--rank", "4"]
    assert main(["finetune", *args, "--steps", "1", "--base-domain", "none", "--no-progress", "--qlora",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "run" / "manifest.json").read_text())["results"]["memory_plan"]
    assert main(["count", *args, "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)["finetune_cpu"]
    qlora = next(r for r in counted["regimes"] if r["regime"] == "QLoRA r=4")
    assert plan["regime"] == "QLoRA r=4" and plan["peak"] == qlora["peak"] and plan["counted_targets"] < 3 * 32
    assert {k: plan[k] for k in ("batch_size", "seq_len", "counted_targets")} == {
        k: counted[k] for k in ("batch_size", "seq_len", "counted_targets")}
    assert f"memory plan: step peak {plan['peak'] / 2**20:,.2f} MiB at the {plan['peak_phase']}" in out
    assert f"3 x {plan['seq_len']}, {plan['counted_targets']:,} of {3 * plan['seq_len']:,} targets counted" in out


def test_a_run_the_planner_does_not_model_says_why(hf_folder):
    from minituner.memory.run_plan import describe_run_plan, plan_run

    folder, batch = hf_folder("llama"), largest_batch([_example(9, 3)], 2)
    for regime, device, scheme, why in [
            (Regime("lora", 4), "cuda", None, "not made for cuda"),
            (Regime("qlora", 4), "cpu", "int8_per_group_64", "not made for int8_per_group_64")]:
        plan, reason = plan_run(folder, regime, "all-linear", batch, False, "fp32", torch.device(device), scheme)
        assert plan is None and why in reason and describe_run_plan(plan, reason) == [f"memory plan: {reason}"]
    plan, reason = plan_run(hf_folder("llama", attention_dropout=0.1), Regime("lora", 4), "all-linear", batch, False,
                            "fp32", CPU)
    assert plan is None and "the model's dropout (0.1) is not modelled for the llama family" in reason
    plan, reason = plan_run(folder, Regime("lora", 4), "all-linear", batch, False, "fp32", CPU, lora_dropout=0.1)
    assert reason == "" and plan["lora_dropout"] == 0.1 and plan["model_dropout"] == 0.0  # planned (test_dropout.py)
    plan, reason = plan_run(hf_folder("gpt2"), Regime("lora", 4), "all-linear", batch, False, "fp32", CPU)
    assert reason == "" and plan["model_dropout"] == pytest.approx(0.1)  # GPT-2's resid_pdrop, planned
    plan, reason = plan_run(folder, Regime("lora", 4), "model.layers.0.self_attn.q_proj", batch, False, "fp32", CPU)
    assert plan is None and reason.startswith("not made, the planner cannot count this run: unknown LoRA target")
    plan, reason = plan_run(folder, Regime("lora", 4), ["q_proj", "v_proj"], batch, False, "fp32", CPU)
    assert reason == "" and plan["seq_len"] == 8 and plan["counted_targets"] == 6
    assert len(describe_run_plan(plan, "")) == 1
    assert len(describe_run_plan({**plan, "available_bytes": plan["peak"] - plan["weights"]}, "")) == 1
    lines = describe_run_plan({**plan, "available_bytes": plan["peak"] - plan["weights"] - 1}, "")
    assert len(lines) == 2 and lines[1].startswith("warning: the planned peak, beyond the weights already loaded, exceeds")

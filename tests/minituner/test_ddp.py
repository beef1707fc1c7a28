"""torchrun data parallel: 2 CPU processes (gloo) train the same adapter as 1 process with the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.train_state import CHECKPOINT_DIR, list_checkpoints
from minigpt.distributed import mean_across_ranks, shard, world_size
from minigpt.io import load_safetensors
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.adapter_io import ADAPTER_FILE

DOCS = "\n\n".join(f"Forecast {i}: wind {i % 7} knots, rain {i % 3} mm, sunny by {i % 12} o'clock." for i in range(80))
FLAGS = ["--rank", "2", "--steps", "4", "--batch-size", "4", "--lr", "0.01", "--warmup-steps", "1",
         "--eval-every", "2", "--checkpoint-every", "2", "--base-domain", "none", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    tok = CharTokenizer.train(DOCS)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, d_model=16)), tok,
              folder / "base")
    (folder / "data.txt").write_text(DOCS, encoding="utf-8")
    return folder


def finetune(base, out, nproc: int, *extra: str, model=None, data=None) -> subprocess.CompletedProcess:
    """`minituner finetune` in nproc processes (torchrun when > 1); model and data default to the fixture's."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "minituner", "finetune", "--base", str(model or base / "base"),
           "--data", str(data or base / "data.txt"), "--out", str(out), *FLAGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def adapter(out) -> dict[str, torch.Tensor]:
    return load_safetensors(out / ADAPTER_FILE)


def losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows]


@pytest.fixture(scope="module")
def runs(base):
    one, two = base / "one", base / "two"
    finetune(base, one, 1)
    done = finetune(base, two, 2)
    return one, two, done


def test_two_processes_train_the_same_adapter_as_one(runs):
    one, two, _ = runs
    a, b = adapter(one), adapter(two)
    assert sorted(a) == sorted(b) and any("lora_B" in k for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max().item())
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # the adapters trained (B moved off zero)
    assert losses(one) == pytest.approx(losses(two), abs=1e-5)  # the logged loss is the global batch's


def test_rank_zero_alone_writes(runs):
    _, two, done = runs
    assert done.stdout.count("wrote ") == 1
    assert len(losses(two)) == 4  # one metrics row per step, not one per rank
    assert [s for s, _ in list_checkpoints(two / CHECKPOINT_DIR)] == [2, 4]


def test_resume_under_torchrun(base, runs):
    _, two, _ = runs
    resumed = base / "resumed"
    subprocess.run(["cp", "-r", str(two), str(resumed)], check=True)
    (resumed / CHECKPOINT_DIR / "step-00000004.safetensors").unlink()  # as if killed after step 2's checkpoint
    finetune(base, resumed, 2, "--resume")
    a, b = adapter(two), adapter(resumed)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
    assert losses(resumed) == pytest.approx(losses(two), abs=1e-6)


def test_two_processes_match_one_on_a_hugging_face_folder(base, hf_folder, hf_words):
    """QLoRA on a llama-family folder (NF4 as it is read, GQA, sliding window) under torchrun."""
    model = hf_folder("mistral", name="mistral-ddp")
    data = base / "words.txt"
    data.write_text("\n\n".join(" ".join(hf_words[(i * 7 + j) % len(hf_words)] for j in range(9)) for i in range(80)))
    one, two = base / "hf-one", base / "hf-two"
    for out, nproc in ((one, 1), (two, 2)):
        finetune(base, out, nproc, "--qlora", "--seq-len", "12", model=model, data=data)
    a, b = adapter(one), adapter(two)
    assert sorted(a) == sorted(b) and any(k.startswith("model.layers.0.self_attn") for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max().item())
    assert losses(one) == pytest.approx(losses(two), abs=1e-5)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """Instruction data whose answers differ in length, so the two ranks' shards count different numbers of tokens."""
    folder = tmp_path_factory.mktemp("ddp-sft")
    records = [{"prompt": f"wind {i}? ", "completion": "calm" if i % 3 else f"force {i % 7} and rising"}
               for i in range(40)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (folder / "data.jsonl").write_text(text, encoding="utf-8")
    torch.manual_seed(0)
    tok = CharTokenizer.train(text + "<|end|>")
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=16)), tok,
              folder / "base")
    return folder


def test_two_processes_match_one_on_masked_instruction_data(sft):
    data = ["--data", str(sft / "data.jsonl")]  # the later --data wins over the data.txt finetune() names
    one, two = sft / "one", sft / "two"
    finetune(sft, one, 1, *data)
    finetune(sft, two, 2, *data)
    a, b = adapter(one), adapter(two)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max().item())
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)
    assert losses(one) == pytest.approx(losses(two), abs=1e-5)


def test_two_processes_accumulating_match_one(sft):
    """--grad-accum 2 under torchrun: each rank's shard of each micro-batch weighs by the step's counted targets,
    and the gradients are synchronised once, in the last micro-batch's backward."""
    extra = ["--data", str(sft / "data.jsonl"), "--batch-size", "2", "--grad-accum", "2"]
    one, two = sft / "one-accum", sft / "two-accum"
    finetune(sft, one, 1, *extra)
    finetune(sft, two, 2, *extra)
    a, b = adapter(one), adapter(two)
    for k in a:  # rounding only: each micro-batch's two rows summed in one product or over the ranks (measured 1e-6)
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5), (k, (a[k] - b[k]).abs().max().item())
    assert losses(one) == pytest.approx(losses(two), abs=1e-5)


def test_single_process_helpers_are_identities():
    x, y = torch.arange(6).view(3, 2), torch.arange(6).view(3, 2) + 1
    assert world_size() == 1
    sx, sy = shard(x, y)
    assert sx is x and sy is y
    t = torch.tensor(2.5)
    assert mean_across_ranks(t) is t


def test_global_batch_must_divide(base, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "minituner",
           "finetune", "--base", str(base / "base"), "--data", str(base / "data.txt"), "--out", str(tmp_path / "x"),
           *FLAGS, "--batch-size", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode != 0 and "must divide evenly over 2 processes" in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_finetune_on_cuda_in_bf16(base):
    out = base / "cuda"
    finetune(base, out, 1, "--device", "cuda", "--precision", "bf16-autocast")  # the old name of bf16
    assert all(t.dtype == torch.float32 for t in adapter(out).values())  # the LoRA masters stay fp32


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl)")
def test_two_gpus_with_nccl_match_one(base, runs):
    one, _, _ = runs
    out = base / "nccl"
    finetune(base, out, 2, "--device", "cuda")
    a, b = adapter(one), adapter(out)
    for k in a:  # CPU vs GPU kernels: equal to float32 rounding, not bit for bit
        assert torch.allclose(a[k], b[k], atol=1e-4, rtol=0), k

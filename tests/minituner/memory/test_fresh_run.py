"""memory.fresh_run: one LoRA/QLoRA setup measured (here in-process and in a fresh process) on a tiny base."""
import pytest
import torch

from minigpt.base_folder import load_config, save_base
from minigpt.data import forecast_documents
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.adapter_io import save_adapter
from minituner.build import build_for_training
from minituner.lora import LoRAConfig
from minituner.memory.fresh_run import Setup, comparison, comparison_table, measure, measure_in_fresh_process
from minituner.planner import MemoryConfig, Regime, minigpt_shape, plan

LORA = LoRAConfig(r=4, target_modules="all-linear")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fresh")
    tok = CharTokenizer.train("\n\n".join(forecast_documents(50)))
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, d_model=32))
    save_base(model, tok, tmp / "base")
    save_adapter(build_for_training(model, "lora", LORA, device="cpu"), tmp / "adapter.safetensors")
    return tmp


def spec(folder, name: str) -> Setup:
    return Setup(name, str(folder / "base"), str(folder / "adapter.safetensors"), LORA.to_dict(), "builtin:forecasts",
                 batch_size=2, seq_len=8, steps=2, seed=0, lr=1e-3)


def test_measured_bytes_are_the_planner_plus_fp32_lora_and_adam_steps(folder):
    rows = {name: measure(spec(folder, name)) for name in ("lora-fp16", "qlora-nf4")}
    assert rows["lora-fp16"]["dtypes"] == ["float16", "float32"] and "uint8" in rows["qlora-nf4"]["dtypes"]
    shape = minigpt_shape(load_config(folder / "base"))
    p = plan(shape, [Regime("lora", 4), Regime("qlora", 4)], "all-linear", MemoryConfig(batch_size=2, seq_len=8))
    planner = {"lora-fp16": p.regimes[0].bytes.to_dict(), "qlora-nf4": p.regimes[1].bytes.to_dict()}
    m = comparison(rows, planner, p.regimes[0].trainable_params, 2 * 6)
    assert m["exact"], m
    table = comparison_table(rows, planner, {"lora-fp16": "LoRA", "qlora-nf4": "QLoRA"})
    assert table.count("\n") == 4 and "**QLoRA / LoRA**" in table


def test_fresh_process_gives_the_same_exact_bytes(folder):
    here = measure(spec(folder, "qlora-nf4"))
    there = measure_in_fresh_process(spec(folder, "qlora-nf4"))
    assert there["after_steps"]["total"] == here["after_steps"]["total"] and there["losses"] == here["losses"]

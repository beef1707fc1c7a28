"""`minituner finetune --qlora` / FinetuneConfig(quant_scheme=...): LoRA trained on a quantized base."""
import json

import pytest
import torch

from minigpt.base_folder import save_base
from minituner.base_model import load_base
from minigpt.data import forecast_documents
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minigpt.train import TrainConfig
from miniquant import QuantizedLinear
from minituner.adapter_io import ADAPTER_FILE, load_adapter
from minituner.cli import main
from minituner.finetune import FinetuneConfig, finetune
from minituner.lora import LoRAConfig, lora_modules, lora_state_dict
from minituner.precision import Fp32Linear
from minituner.build import wrap_minigpt_qlora


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tok = CharTokenizer.train("\n\n".join(forecast_documents(200)))
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=32)), tok, folder)
    return folder


def quick(steps=6) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=steps, eval_batches=2)


def test_finetune_with_quant_scheme_trains_lora_on_an_nf4_base(base, tmp_path):
    cfg = FinetuneConfig(lora=LoRAConfig(r=4, alpha=8.0, target_modules="q_proj,v_proj"), train=quick(),
                         quant_scheme="nf4_per_group_64", base_domain=None)
    res = finetune(base, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    mods = lora_modules(res.model)
    assert len(mods) == 4 and all(type(m.base_layer) is QuantizedLinear for m in mods.values())
    assert type(res.model.blocks[0].attn.k_proj) is Fp32Linear  # not a target: stays float (fp32_gemm's products)
    assert res.summary["params_trainable"] == sum(t.numel() for t in lora_state_dict(res.model).values())
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["quant_scheme"] == "nf4_per_group_64"
    # the adapter file is an ordinary LoRA adapter: it loads on an NF4 base and gives the trained outputs
    fresh, _ = load_base(base)
    wrap_minigpt_qlora(fresh, r=4, alpha=8.0, targets="q_proj,v_proj", device="cpu", adapter_name="qlora")
    load_adapter(fresh, tmp_path / "run" / ADAPTER_FILE, adapter_name="trained")
    from minituner.zoo import set_adapter

    set_adapter(fresh, "trained")
    x = torch.randint(0, 20, (2, 16))
    with torch.no_grad():
        assert torch.equal(fresh(x), res.model.eval()(x))


def test_qlora_resumes_from_an_adapter(base, tmp_path):
    first = FinetuneConfig(lora=LoRAConfig(r=4), train=quick(), base_domain=None)
    finetune(base, tmp_path / "lora", first, progress=False, log=lambda *_: None)
    cfg = FinetuneConfig(lora=LoRAConfig(r=4), train=quick(3), base_domain=None, quant_scheme="int8_per_group_16",
                         init_adapter=str(tmp_path / "lora"))
    res = finetune(base, tmp_path / "qlora", cfg, progress=False, log=lambda *_: None)
    assert all(m.base_layer.scheme == "int8_per_group_16" for m in lora_modules(res.model).values())


def test_cli_qlora_flags(base, tmp_path, capsys):
    common = ["finetune", "--base", str(base), "--rank", "4", "--steps", "2", "--batch-size", "4",
              "--eval-every", "2", "--base-domain", "none", "--no-progress"]
    assert main([*common, "--qlora", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["config"]["quant_scheme"] == "nf4_per_group_64"
    assert main([*common, "--quant-scheme", "int4_per_group_16", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["config"]["quant_scheme"] == "int4_per_group_16"
    capsys.readouterr()
    assert main([*common, "--quant-scheme", "nf3", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown quantization scheme 'nf3'" in err
    assert not (tmp_path / "c").exists()
    assert main([*common, "--qlora", "--full", "--out", str(tmp_path / "d")]) == 2
    assert "--full" in capsys.readouterr().err

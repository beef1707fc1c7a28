"""PEFT both ways on a Hugging Face base: adapters we write load in PEFT, adapters PEFT writes load in ours."""
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from minituner.adapter_io import load_adapter  # noqa: E402
from minituner.hf_load import load_hf_decoder  # noqa: E402
from minituner.lora import LoRAConfig, apply_lora, lora_modules  # noqa: E402
from minituner.peft_format import save_peft_adapter  # noqa: E402
from minituner.qlora import quantized_modules  # noqa: E402

IDS = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(2))


def randomize_b(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family,targets", [("llama", "all-linear"), ("qwen2", ["q_proj", "v_proj", "down_proj"])])
def test_our_adapter_loads_in_peft(hf_folder, hf_ref, tmp_path, family, targets):
    folder = hf_folder(family, name=f"{family}-peft", num_key_value_heads=2)
    ours = load_hf_decoder(folder)
    apply_lora(ours, LoRAConfig(r=4, alpha=8.0, target_modules=targets))
    randomize_b(ours)
    out = save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    keys = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys  # PEFT's own key
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(folder)
    assert set(cfg["target_modules"]) <= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(hf_ref(folder), out).eval()
    with torch.no_grad():
        assert (ours(IDS) - theirs(input_ids=IDS).logits).abs().max() < 1e-4


def test_peft_adapter_loads_in_ours(hf_folder, hf_ref, tmp_path):
    folder = hf_folder("mistral", name="mistral-peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(hf_ref(folder), peft.LoraConfig(r=4, lora_alpha=16,
                                                                       target_modules=["q_proj", "k_proj", "up_proj"]))
    randomize_b(theirs)
    theirs.eval()
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_hf_decoder(folder)
    cfg = load_adapter(ours, tmp_path / "peft")
    assert cfg.r == 4 and len(lora_modules(ours)) == 2 * 3
    with torch.no_grad():
        assert (ours(IDS) - theirs(input_ids=IDS).logits).abs().max() < 1e-4


def test_peft_adapter_on_a_streamed_nf4_base(hf_folder, hf_ref, tmp_path):
    """QLoRA: a PEFT adapter on our NF4 base computes PEFT on the transformers model holding the dequantized weights."""
    folder = hf_folder("llama", name="llama-plain")
    ours = load_hf_decoder(folder, quantize=("all-linear", "nf4_per_group_64"))
    hf = hf_ref(folder)
    with torch.no_grad():
        for path, q in quantized_modules(ours).items():
            hf.get_submodule(path).weight.copy_(q.dequantize(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear"))
    randomize_b(theirs)
    theirs.eval().save_pretrained(tmp_path / "peft")
    load_adapter(ours, tmp_path / "peft")
    assert len(lora_modules(ours)) == len(quantized_modules(ours)) == 2 * 7
    with torch.no_grad():
        assert (ours(IDS) - theirs(input_ids=IDS).logits).abs().max() < 1e-4

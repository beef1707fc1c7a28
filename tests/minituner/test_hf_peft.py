"""PEFT both ways on a Hugging Face base: adapters we write load in PEFT, adapters PEFT writes load in ours."""
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from minigpt.errors import InputError  # noqa: E402

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


def test_null_target_modules_are_peft_default_for_the_model_type(hf_folder, hf_ref, tmp_path):
    """target_modules null in adapter_config.json: PEFT takes its default for the base's model type (q_proj and
    v_proj for a Llama) and leaves other tensors out. Ours loads the same modules with PEFT's logits; tensors for
    another module (k_proj, which PEFT would drop) and a selected module without tensors are refused by name."""
    folder = hf_folder("llama", name="llama-null-targets")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = peft.get_peft_model(hf_ref(folder),
                                   peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomize_b(made)
    made.save_pretrained(tmp_path / "peft")
    config = tmp_path / "peft" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "target_modules": None}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(hf_ref(folder), tmp_path / "peft").eval()
    assert set(theirs.peft_config["default"].target_modules) == {"q_proj", "v_proj"}
    ours = load_hf_decoder(folder)
    load_adapter(ours, tmp_path / "peft")
    assert sorted(p.rsplit(".", 1)[-1] for p in lora_modules(ours)) == ["q_proj"] * 2 + ["v_proj"] * 2
    with torch.no_grad():
        assert (ours(IDS) - theirs(input_ids=IDS).logits).abs().max() < 1e-4
    weights = tmp_path / "peft" / "adapter_model.safetensors"
    sd = load_file(weights)
    extra = {k.replace("q_proj", "k_proj"): v.clone() for k, v in sd.items() if "q_proj" in k}
    save_file({**sd, **extra}, weights)
    with pytest.raises(InputError, match=r"target_modules null \(PEFT's default for the model type\) does not select"):
        load_adapter(load_hf_decoder(folder), tmp_path / "peft")
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.v_proj" not in k}, weights)
    model = load_hf_decoder(folder)
    with pytest.raises(InputError, match=r"holds no tensors for \(model\.layers\.1\.self_attn\.v_proj\)"):
        load_adapter(model, tmp_path / "peft")
    assert not lora_modules(model)

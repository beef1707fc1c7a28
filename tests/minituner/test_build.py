"""build_for_training: the one path from a loaded base to a model ready to train (full, LoRA, QLoRA)."""
import pytest
import torch
import torch.nn as nn

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from miniquant import DEFAULT_QUANT_SCHEME, QuantizedLinear
from minituner.build import build_for_training, quantize_step
from minituner.lora import LoRAConfig, LoRALinear, lora_modules
from minituner.qlora import quantized_modules

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=32)


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CFG)


def trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_full_trains_every_parameter_in_fp32():
    model = build_for_training(tiny(), "full", device="cpu")
    assert trainable(model) == {n for n, _ in model.named_parameters()} and not lora_modules(model)
    with pytest.raises(InputError, match="float32"):
        build_for_training(tiny(), "full", device="cpu", compute_dtype=torch.bfloat16)


def test_lora_and_qlora_train_only_the_factors():
    lora = build_for_training(tiny(), "lora", LoRAConfig(r=4, target_modules="q_proj,v_proj"), device="cpu")
    assert all("lora_" in n for n in trainable(lora)) and len(lora_modules(lora)) == 4
    assert not quantized_modules(lora)
    qlora = build_for_training(tiny(), "qlora", LoRAConfig(r=4, target_modules="q_proj,v_proj"), device="cpu")
    assert trainable(qlora) == trainable(lora)
    assert all(q.scheme == DEFAULT_QUANT_SCHEME for q in quantized_modules(qlora).values())
    assert len(quantized_modules(qlora)) == 4 and qlora.wte.weight.dtype == torch.float32  # CPU: fp32 compute


def test_qlora_keeps_targets_a_loader_already_quantized():
    """A loader that quantized the targets while reading hands them over; build does not quantize twice."""
    model = tiny()
    paths = [f"blocks.{i}.attn.q_proj" for i in range(CFG.n_layer)]
    assert quantize_step(model, paths, DEFAULT_QUANT_SCHEME) == paths
    before = {p: model.get_submodule(p) for p in paths}
    build_for_training(model, "qlora", LoRAConfig(r=4, target_modules="q_proj,v_proj"), device="cpu")
    for p in paths:
        wrapped = model.get_submodule(p)
        assert isinstance(wrapped, LoRALinear) and wrapped.base_layer is before[p]
    assert all(isinstance(model.get_submodule(f"blocks.{i}.attn.v_proj.base_layer"), QuantizedLinear)
               for i in range(CFG.n_layer))
    with pytest.raises(InputError, match="already quantized"):
        quantize_step(model, [f"{paths[0]}.base_layer"], "int8_per_group_32")


def test_bad_input_changes_nothing():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match="method"):
        build_for_training(model, "dora", device="cpu")
    with pytest.raises(InputError, match="rank"):
        build_for_training(model, "qlora", LoRAConfig(r=64), device="cpu")
    with pytest.raises(InputError, match="compute dtype"):
        build_for_training(model, "lora", device="cpu", compute_dtype=torch.float64)
    assert not lora_modules(model) and not quantized_modules(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_qlora_defaults_to_bf16_and_lora_to_fp32():
    qlora = build_for_training(tiny(), "qlora", LoRAConfig(r=4))
    assert qlora.wte.weight.device.type == "cuda" and qlora.wte.weight.dtype == torch.bfloat16
    lora = build_for_training(tiny(), "lora", LoRAConfig(r=4))
    assert lora.wte.weight.device.type == "cuda" and lora.wte.weight.dtype == torch.float32

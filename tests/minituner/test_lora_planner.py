"""The planner's arithmetic agrees with the LoRA parameters apply_lora actually creates."""
import pytest
import torch

from minigpt.model import GPTConfig, MiniGPT
from minituner.lora import LoRAConfig, apply_lora, lora_state_dict, trainable_numel

planner = pytest.importorskip("minituner.planner")


@pytest.mark.parametrize("cfg", [
    GPTConfig(vocab_size=104, block_size=128),  # the Lab 02 base: d_model 64, 4 layers
    GPTConfig(vocab_size=37, block_size=16, n_layer=3, n_head=2, d_model=32, d_ff=48, bias=False),
])
@pytest.mark.parametrize("r,targets", [(8, "all-linear"), (4, "q_proj,v_proj"), (2, "mlp.fc1"), (1, "o_proj,fc2")])
def test_trainable_numel_equals_planner_lora_count(cfg, r, targets):
    torch.manual_seed(0)
    model = MiniGPT(cfg)
    apply_lora(model, LoRAConfig(r=r, target_modules=targets))
    shape = planner.minigpt_shape(cfg)
    assert trainable_numel(model) == planner.lora_trainable_params(shape, r, targets)
    tensor_bytes = sum(t.numel() * t.element_size() for t in lora_state_dict(model).values())
    assert tensor_bytes == planner.adapter_bytes(shape, r, targets, bytes_per_param=4)  # we store fp32
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n) == planner.total_params(shape)

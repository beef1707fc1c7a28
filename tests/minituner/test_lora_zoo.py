"""The adapter zoo: named adapters on one base, hot swap, disable, weighted combination."""

import pytest
import torch

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minituner.adapter_io import load_adapter, save_adapter
from minituner.lora import LoRAConfig, adapter_names, apply_lora, lora_modules, merge_lora, unmerge_lora
from minituner.zoo import (active_adapters, adapters_disabled, combine_adapters, delete_adapter, disable_adapters,
                           set_adapter, zoo_summary)


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=19, block_size=12, n_layer=2, n_head=2, d_model=16)).eval()


X = torch.randint(0, 19, (2, 12), generator=torch.Generator().manual_seed(5))


def randomize(model, adapter: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            if adapter in m.lora_B:
                m.lora_B[adapter].weight.copy_(torch.randn(m.lora_B[adapter].weight.shape, generator=g) * 0.1)


@pytest.fixture
def zoo(tmp_path):
    """A base with adapters 'a' (r=4, all-linear) and 'b' (r=2, attention only), plus each saved alone."""
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=8), "a")
    randomize(model, "a", 1)
    save_adapter(model, tmp_path / "a.safetensors", "a")
    apply_lora(model, LoRAConfig(r=2, alpha=2, target_modules="q_proj,k_proj,v_proj,o_proj"), "b")
    randomize(model, "b", 2)
    save_adapter(model, tmp_path / "b.safetensors", "b")
    return model, tmp_path


def alone(path) -> MiniGPT:
    model = tiny()
    load_adapter(model, path)
    return model


def test_hot_swap_gives_each_adapters_own_output(zoo):
    model, tmp = zoo
    base_tensors = {k: v.data_ptr() for k, v in model.state_dict().items() if "base_layer" in k}
    assert adapter_names(model) == ["a", "b"]
    for name in ("a", "b", "a"):
        set_adapter(model, name)
        assert active_adapters(model) == {name: 1.0}
        torch.testing.assert_close(model(X), alone(tmp / f"{name}.safetensors")(X), rtol=0, atol=1e-6)
    assert {k: v.data_ptr() for k, v in model.state_dict().items() if "base_layer" in k} == base_tensors
    assert not torch.allclose(alone(tmp / "a.safetensors")(X), alone(tmp / "b.safetensors")(X))


def test_only_the_active_adapter_is_trainable(zoo):
    model, _ = zoo
    set_adapter(model, "b")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".b." in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == 2 * 4 * 2 * (16 + 16)


def test_disabled_adapters_give_the_base_output(zoo):
    model, _ = zoo
    base = tiny()
    with adapters_disabled(model):
        assert torch.equal(model(X), base(X))
    assert not torch.equal(model(X), base(X))
    disable_adapters(model)
    assert torch.equal(model(X), base(X))


def test_weighted_combination_is_the_weighted_sum_of_updates(zoo):
    model, tmp = zoo
    layer, h = model.blocks[1].attn.v_proj, torch.randn(4, 16)
    base = layer.base_layer(h)
    set_adapter(model, "a")
    ya = layer(h)
    set_adapter(model, "b")
    yb = layer(h)
    set_adapter(model, {"a": 0.7, "b": -0.2})  # one layer is linear in the adapter weights
    torch.testing.assert_close(layer(h) - base, 0.7 * (ya - base) - 0.2 * (yb - base), rtol=0, atol=1e-6)
    set_adapter(model, {"a": 0.5, "b": 0.5})
    mixed = model(X)
    combine_adapters(model, {"a": 0.5, "b": 0.5}, "ab")
    set_adapter(model, "ab")
    torch.testing.assert_close(model(X), mixed, rtol=0, atol=1e-5)
    q = model.blocks[0].attn.q_proj
    assert q.r["ab"] == 6
    torch.testing.assert_close(q.delta_weight({"ab": 1.0}), q.delta_weight({"a": 0.5, "b": 0.5}), rtol=0, atol=1e-6)
    fc1 = model.blocks[0].mlp.fc1  # b does not touch the MLP: its block of the combined adapter is zero
    assert fc1.r["ab"] == 6 and torch.count_nonzero(fc1.lora_B["ab"].weight[:, 4:]) == 0


def test_combined_adapter_saves_and_loads_alone(zoo):
    model, tmp = zoo
    combine_adapters(model, {"a": 1.0, "b": -0.3}, "mix")
    set_adapter(model, "mix")
    save_adapter(model, tmp / "mix.safetensors", "mix")
    torch.testing.assert_close(alone(tmp / "mix.safetensors")(X), model(X), rtol=0, atol=1e-6)


def test_zoo_errors_are_input_errors(zoo):
    model, _ = zoo
    with pytest.raises(InputError, match="adapters: \\['a', 'b'\\]"):
        set_adapter(model, "c")
    with pytest.raises(InputError, match="already"):
        apply_lora(model, LoRAConfig(r=2), "a")
    with pytest.raises(InputError, match="already exists"):
        combine_adapters(model, {"a": 1.0}, "b")
    with pytest.raises(InputError, match="combined rank"):
        apply_lora(model, LoRAConfig(r=16, alpha=1, target_modules="q_proj"), "big")
        combine_adapters(model, {"a": 1.0, "big": 1.0}, "too-big")
    merge_lora(model)
    with pytest.raises(InputError, match="unmerge"):
        set_adapter(model, "b")
    unmerge_lora(model)


def test_delete_adapter_and_summary(zoo):
    model, tmp = zoo
    assert [(r["name"], r["r"], r["modules"]) for r in zoo_summary(model)] == [("a", 4, 12), ("b", 2, 8)]
    delete_adapter(model, "b")
    assert adapter_names(model) == ["a"]
    set_adapter(model, "a")
    torch.testing.assert_close(model(X), alone(tmp / "a.safetensors")(X), rtol=0, atol=1e-6)

"""LoRALinear, apply_lora, merge/unmerge, adapter save/load: the behaviour Theory 02 fixes."""
import copy
import json
import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import TrainConfig, train
from minituner.adapter_io import load_adapter, read_adapter, save_adapter
from minituner.lora import (LoRAConfig, LoRALinear, adapter_config, apply_lora, find_targets, load_lora_state_dict,
                            lora_modules, lora_state_dict, merge_and_unload, merge_lora, trainable_numel, unload,
                            unmerge_lora)
from minituner.planner import minigpt_shape
from minituner.planner.counts import resolve_targets

BLOCK_LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc1", "mlp.fc2")


def tiny(seed: int = 0, **kw) -> MiniGPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=23, block_size=16, n_layer=2, n_head=2, d_model=16)
    return MiniGPT(GPTConfig(**{**cfg, **kw})).eval()


def tokens(seed: int = 1, vocab: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(seed))


def randomize_b(model: nn.Module, seed: int = 2, adapter: str = "default") -> None:
    """Trained adapters have B != 0; give B random values so the LoRA path matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            w = m.lora_B[adapter].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.1)


class Int8Linear(nn.Module):
    """A stand-in quantized linear honouring miniquant's contract: no weight Parameter, dequantize()."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale  # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(), self.bias)


def quantize(model: MiniGPT) -> MiniGPT:
    for block in model.blocks:
        for path in BLOCK_LINEARS:
            parent, leaf = path.split(".")
            mod = getattr(block, parent)
            setattr(mod, leaf, Int8Linear(getattr(mod, leaf)))
    return model


def test_step0_output_equals_base_also_with_dropout_in_train_mode():
    base = tiny()
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.5))
    x = tokens()
    assert torch.equal(model(x), base(x))
    model.train(), base.train()
    assert torch.equal(model(x), base(x))  # B = 0: dropout on the LoRA path cannot change the output


def test_init_follows_peft_kaiming_uniform_and_zero_b():
    layer = LoRALinear(nn.Linear(64, 32), r=8, alpha=16)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.shape == (8, 64) and b.shape == (32, 8)
    assert torch.count_nonzero(b) == 0
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64
    assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound
    assert layer.scaling["default"] == 2.0
    rs = LoRALinear(nn.Linear(64, 32), r=16, alpha=16, use_rslora=True)
    assert rs.scaling["default"] == pytest.approx(16 / 4)


def test_all_linear_targets_every_block_linear_never_lm_head():
    model = tiny()
    paths = apply_lora(model, LoRAConfig(r=2))
    assert paths == [f"blocks.{i}.{p}" for i in range(2) for p in BLOCK_LINEARS]
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.wte.weight


def test_named_and_path_suffix_targets():
    assert find_targets(tiny(), "q_proj,v_proj") == [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert find_targets(tiny(), ["blocks.1.mlp.fc2"]) == ["blocks.1.mlp.fc2"]
    assert find_targets(tiny(), ["attn.o_proj"]) == ["blocks.0.attn.o_proj", "blocks.1.attn.o_proj"]


@pytest.mark.parametrize("target", ["nope", "ln_1", "lm_head", "wte", "all-linear,lm_head"])
def test_unknown_target_lists_valid_names(target):
    """all-linear beside a name it does not cover (the head) is refused too, never silently dropped."""
    with pytest.raises(InputError, match="valid names") as e:
        apply_lora(tiny(), LoRAConfig(target_modules=target.split(",")))
    assert "q_proj" in str(e.value) and "all-linear" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError, match="unknown LoRA target"):
        resolve_targets(minigpt_shape(tiny().config), target)


@pytest.mark.parametrize("kw", [{"r": 0}, {"r": -1}, {"r": 17}, {"alpha": 0}, {"alpha": -2.0},
                                {"alpha": float("nan")}, {"dropout": 1.0}, {"target_modules": []}])
def test_bad_config_is_input_error_and_model_untouched(kw):
    model = tiny()
    with pytest.raises(InputError):
        apply_lora(model, LoRAConfig(**{"r": 4, **kw}))
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())


def test_only_lora_parameters_train_and_count_is_r_times_in_plus_out():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.endswith("bias"))
    d, ff = 16, 64
    per_block = 4 * 4 * (d + d) + 4 * (d + ff) + 4 * (ff + d)
    assert trainable_numel(model) == 2 * per_block


def test_base_weights_unchanged_after_optimizer_steps():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    data = torch.randint(0, 23, (400,), generator=torch.Generator().manual_seed(3))
    cfg = TrainConfig(steps=5, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=5, eval_batches=1, weight_decay=0.1)
    train(model, data, data, cfg, progress=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.count_nonzero(m.lora_B["default"].weight) > 0 for m in lora_modules(model).values())


def test_merge_equals_w_plus_scaled_ba_and_round_trips():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=12))
    randomize_b(model)
    x = tokens()
    y = model(x)
    layer = model.blocks[0].attn.q_proj
    w0 = layer.base_layer.weight.detach().clone()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    merge_lora(model)
    torch.testing.assert_close(layer.base_layer.weight, w0 + (12 / 4) * b @ a, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)
    merged_once = layer.base_layer.weight.detach().clone()
    merge_lora(model)  # idempotent
    assert torch.equal(layer.base_layer.weight, merged_once)
    unmerge_lora(model)
    unmerge_lora(model)  # idempotent too
    torch.testing.assert_close(layer.base_layer.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)


def test_merge_refuses_non_finite_result_and_changes_nothing():
    layer = LoRALinear(nn.Linear(8, 8), r=2, alpha=4)
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(3e38)
        layer.lora_A["default"].weight.fill_(3e38)
    w0 = layer.base_layer.weight.detach().clone()
    with pytest.raises(FloatingPointError, match="non-finite"):
        layer.merge()
    assert torch.equal(layer.base_layer.weight, w0) and not layer.merged_adapters


def test_merge_and_unload_gives_plain_linears_with_same_logits():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=8, use_rslora=True))
    randomize_b(model)
    x = tokens()
    y = model(x)
    merge_and_unload(model)
    assert not lora_modules(model) and type(model.blocks[0].mlp.fc1) is nn.Linear
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)


def test_unload_restores_the_base():
    base = tiny()
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(r=4))
    randomize_b(model)
    unload(model)
    x = tokens()
    assert not lora_modules(model) and torch.equal(model(x), base(x))


def test_adapter_keys_contain_lora_and_name_the_module():
    model = tiny()
    apply_lora(model, LoRAConfig(r=3, target_modules="q_proj"))
    sd = lora_state_dict(model)
    assert sorted(sd) == sorted(f"blocks.{i}.attn.q_proj.lora_{ab}.weight" for i in range(2) for ab in "AB")
    assert sd["blocks.0.attn.q_proj.lora_A.weight"].shape == (3, 16)
    assert sd["blocks.0.attn.q_proj.lora_B.weight"].shape == (16, 3)


def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules="q_proj,fc2"))
    randomize_b(model)
    save_adapter(model, tmp_path / "a.safetensors")
    fresh = tiny()
    cfg = load_adapter(fresh, tmp_path / "a.safetensors")
    assert (cfg.r, cfg.alpha, cfg.dropout) == (4, 8.0, 0.1)
    for k, v in lora_state_dict(model).items():
        assert torch.equal(lora_state_dict(fresh)[k], v)
    x = tokens()
    assert torch.equal(fresh(x), model(x))
    assert adapter_config(fresh).target_modules == adapter_config(model).target_modules


def test_wrong_rank_names_the_wrong_shape_keys():
    src = tiny()
    apply_lora(src, LoRAConfig(r=4))
    dst = tiny()
    apply_lora(dst, LoRAConfig(r=2))
    with pytest.raises(InputError, match=r"wrong shape \[blocks\.0\.attn\.k_proj\.lora_A\.weight \(file \(4, 16\), model \(2, 16\)\)"):
        load_lora_state_dict(dst, lora_state_dict(src))


def test_adapter_for_another_base_names_missing_and_unexpected(tmp_path):
    src = tiny(n_layer=3)
    apply_lora(src, LoRAConfig(r=4))
    save_adapter(src, tmp_path / "a.safetensors")
    dst = tiny()  # 2 layers
    with pytest.raises(InputError, match=r"unexpected \[blocks\.2\.") as e:
        load_adapter(dst, tmp_path / "a.safetensors")
    assert "missing []" in str(e.value)
    wide = tiny(d_model=32)
    with pytest.raises(InputError, match="wrong shape"):
        load_adapter(wide, tmp_path / "a.safetensors")
    x = tokens()
    assert torch.equal(wide(x), tiny(d_model=32)(x))  # a failed load leaves the model as it was


def test_missing_keys_are_allowed_only_when_not_strict():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4))
    sd = dict(lora_state_dict(model))
    sd.pop("blocks.1.mlp.fc2.lora_B.weight")
    with pytest.raises(InputError, match=r"missing \[blocks\.1\.mlp\.fc2\.lora_B\.weight\]"):
        load_lora_state_dict(model, sd)
    assert load_lora_state_dict(model, sd, strict=False).missing_keys == ["blocks.1.mlp.fc2.lora_B.weight"]


def test_loading_touches_only_lora_parameters():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4))
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    sd = {k: torch.full_like(v, 0.5) for k, v in lora_state_dict(model).items()}
    load_lora_state_dict(model, sd)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())
    bad = {**sd, "blocks.0.attn.q_proj.base_layer.weight": torch.zeros(16, 16)}
    with pytest.raises(InputError, match="unexpected"):
        load_lora_state_dict(model, bad)


def test_non_finite_adapter_is_refused():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4))
    sd = {k: v.clone() for k, v in lora_state_dict(model).items()}
    sd["blocks.0.mlp.fc1.lora_B.weight"][0, 0] = float("nan")
    with pytest.raises(InputError, match="non-finite"):
        load_lora_state_dict(model, sd)


def test_integer_adapter_tensors_are_refused_and_the_model_keeps_its_factors():
    model = tiny()
    apply_lora(model, LoRAConfig(r=4))
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    sd = {k: torch.ones_like(v, dtype=torch.int32) for k, v in before.items()}
    with pytest.raises(InputError, match=r"adapter tensor blocks\.0\..*\.lora_A\.weight is int32; LoRA factors are floating"):
        load_lora_state_dict(model, sd)
    assert all(torch.equal(v, lora_state_dict(model)[k]) for k, v in before.items())


def test_an_adapter_file_without_tensors_says_so(tmp_path):
    from safetensors.torch import save_file

    save_file({}, tmp_path / "empty.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match="the adapter holds no tensors"):
        load_adapter(tiny(), tmp_path / "empty.safetensors")


def test_pt_adapter_loads_with_weights_only(tmp_path):
    model = tiny()
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    randomize_b(model)
    # a seed-style .pt: parameters named without '.weight'
    torch.save({k.removesuffix(".weight"): v.clone() for k, v in lora_state_dict(model).items()}, tmp_path / "adapter_final.pt")
    fresh = tiny()
    with pytest.raises(InputError, match="records no LoRA config"):
        load_adapter(fresh, tmp_path / "adapter_final.pt")
    load_adapter(fresh, tmp_path / "adapter_final.pt", config=LoRAConfig(r=4, alpha=8))
    x = tokens()
    assert torch.equal(fresh(x), model(x))


class _Evil:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickle_with_code_is_refused_and_not_run(tmp_path):
    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"x.lora_A.weight": evil}, protocol=2))
    with pytest.raises(InputError, match="weights_only"):
        read_adapter(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def test_lora_on_quantized_base_has_the_same_keys_and_merges_explicitly():
    flt, q = tiny(), quantize(tiny())
    apply_lora(flt, LoRAConfig(r=4, alpha=8))
    apply_lora(q, LoRAConfig(r=4, alpha=8))
    sd_f, sd_q = lora_state_dict(flt), lora_state_dict(q)
    assert {k: v.shape for k, v in sd_f.items()} == {k: v.shape for k, v in sd_q.items()}
    assert all("lora_" in n for n, p in q.named_parameters() if p.requires_grad)
    x = tokens()
    y0 = q(x)
    randomize_b(q)
    y = q(x)
    assert not torch.equal(y, y0)
    layer = q.blocks[0].attn.q_proj
    with pytest.raises(InputError, match="merged_linear"):
        layer.merge()
    lin = layer.merged_linear()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert type(lin) is nn.Linear and lin.weight.dtype == torch.float32
    torch.testing.assert_close(lin.weight, layer.base_layer.dequantize() + 2.0 * b @ a, rtol=0, atol=1e-6)
    h = torch.randn(5, 16)
    torch.testing.assert_close(lin(h), layer(h), rtol=0, atol=1e-5)
    merge_and_unload(q)
    torch.testing.assert_close(q(x), y, rtol=0, atol=1e-4)


@pytest.mark.parametrize("scheme", ["nf4_per_group_64", "int8_per_group_16"])
def test_lora_trains_on_a_miniquant_base_and_leaves_it_untouched(scheme):
    from miniquant import QuantizedLinear

    model = tiny()
    for block in model.blocks:
        for path in BLOCK_LINEARS:
            parent, leaf = path.split(".")
            mod = getattr(block, parent)
            setattr(mod, leaf, QuantizedLinear.from_linear(getattr(mod, leaf), scheme))
    x = tokens()
    y_q = model(x)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    assert torch.equal(model(x), y_q)
    ref = tiny()
    apply_lora(ref, LoRAConfig(r=4, alpha=8))
    assert lora_state_dict(model).keys() == lora_state_dict(ref).keys()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    data = torch.randint(0, 23, (400,), generator=torch.Generator().manual_seed(3))
    train(model, data, data, TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=3, eval_batches=1),
          progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    assert all(torch.count_nonzero(m.lora_B["default"].weight) for m in lora_modules(model).values())
    model.eval()
    y = model(x)
    merge_and_unload(model)
    assert type(model.blocks[0].attn.q_proj) is nn.Linear
    torch.testing.assert_close(model(x), y, rtol=0, atol=1e-5)


def test_an_adapter_file_whose_tensors_and_metadata_disagree_is_damaged(tmp_path):
    """A minituner file records the paths its run wrapped; a file cut short (a module's tensors gone) or pieced
    together (tensors its metadata does not name) is refused by name, not loaded as a smaller adapter."""
    from safetensors.torch import load_file, save_file

    from minituner.adapter_io import read_metadata

    model = tiny()
    apply_lora(model, LoRAConfig(r=4, target_modules="q_proj,fc2"))
    save_adapter(model, tmp_path / "a.safetensors")
    sd, meta = load_file(tmp_path / "a.safetensors"), read_metadata(tmp_path / "a.safetensors")
    cut = {k: v for k, v in sd.items() if not k.startswith("blocks.1.mlp.fc2.")}
    save_file(cut, tmp_path / "cut.safetensors", metadata=meta)
    with pytest.raises(InputError, match=r"damaged adapter: its metadata names 1 module\(s\) it holds no tensors "
                                         r"for \(blocks\.1\.mlp\.fc2\)"):
        load_adapter(tiny(), tmp_path / "cut.safetensors")
    named = json.loads(meta["target_modules"])
    save_file(sd, tmp_path / "more.safetensors",
              metadata={**meta, "target_modules": json.dumps([p for p in named if p != "blocks.0.attn.q_proj"])})
    with pytest.raises(InputError, match=r"holds tensors for 1 module\(s\) its metadata does not name "
                                         r"\(blocks\.0\.attn\.q_proj\)"):
        load_adapter(tiny(), tmp_path / "more.safetensors")

"""build_for_training("qlora"), through wrap_minigpt_qlora: quantize the targets, wrap them with LoRA,
train only the LoRA factors."""
import pytest
import torch
import torch.nn as nn

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import TrainConfig, lm_loss, train
from miniquant import QuantizationError, QuantizedLinear
from minituner.adapter_io import load_adapter, save_adapter
from minituner.lora import LoRALinear, apply_lora, lora_modules, lora_state_dict
from minituner.precision import Fp32Linear
from minituner.planner import lora_trainable_params, minigpt_shape, nf4_weight_bytes, quantized_params, total_params
from minituner.build import training_device, wrap_minigpt_qlora
from minituner.qlora import (check_qlora, compare_logits, param_summary, print_trainable_parameters, quantize_linears,
                             quantized_modules, weight_errors)
from minituner.zoo import adapters_disabled

CFG = GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=2, d_model=32)  # d_ff 128
BLOCK_LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc1", "mlp.fc2")


def tiny(seed: int = 0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(CFG).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (3, 12), generator=torch.Generator().manual_seed(seed))


def qlora(**kw) -> MiniGPT:
    return wrap_minigpt_qlora(tiny(), device="cpu", **kw)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", ["mlp.fc1"]])
def test_trainable_set_is_exactly_the_lora_factors(targets):
    model = qlora(r=4, alpha=8.0, targets=targets)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * len(lora_modules(model))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora_trainable_params(
        minigpt_shape(CFG), 4, targets)
    for path, m in lora_modules(model).items():
        assert type(m.base_layer) is QuantizedLinear and m.base_layer.scheme == "nf4_per_group_64"
        assert not list(m.base_layer.parameters())  # buffers only
        for factor in (m.lora_A["default"], m.lora_B["default"]):  # LoRA is never quantized
            assert type(factor) is nn.Linear and factor.weight.dtype == torch.float32
    # only the targets are quantized; the other block Linears stay float (Fp32Linear: fp32 through fp32_gemm)
    assert set(quantized_modules(model)) == {f"{p}.base_layer" for p in lora_modules(model)}
    floats = [n for n, m in model.named_modules() if type(m) is Fp32Linear and n != "lm_head"]
    assert len(floats) == CFG.n_layer * len(BLOCK_LINEARS) - len(lora_modules(model))


def test_gradients_reach_only_lora_and_the_base_is_unchanged():
    model = qlora(r=4, alpha=8.0)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    x = tokens()
    lm_loss(model, x[:, :-1], x[:, 1:]).backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all()
        else:
            assert p.grad is None, name
    assert all(torch.count_nonzero(m.lora_B["default"].weight.grad) for m in lora_modules(model).values())
    data = torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    train(model, data, data, TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=3, eval_batches=1),
          progress=False)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())  # NF4 codes, absmax, embeddings, norms, biases
    assert all(torch.count_nonzero(m.lora_B["default"].weight) for m in lora_modules(model).values())


@pytest.mark.parametrize("scheme", ["nf4_per_group_64", "int8_per_group_32", "int4_per_group_16"])
def test_step0_equals_the_quantized_base(scheme):
    x = tokens()
    quantized = tiny()
    quantize_linears(quantized, [f"blocks.{i}.{p}" for i in range(CFG.n_layer) for p in BLOCK_LINEARS], scheme)
    model = qlora(r=4, alpha=8.0, quant_scheme=scheme)
    with torch.no_grad():
        y_q, y = quantized(x), model(x)
        assert torch.equal(y, y_q)  # B = 0: the LoRA path adds exactly nothing
        with adapters_disabled(model):
            assert torch.equal(model(x), y_q)
        diff = compare_logits(tiny()(x), y)
    assert 0 < diff["ratio"] < (0.02 if scheme.startswith("int8") else 0.5)


def test_summary_counts_quantized_weights_by_element_and_agrees_with_the_planner():
    shape = minigpt_shape(CFG)
    for targets in ("all-linear", "q_proj,v_proj"):
        s = param_summary(qlora(r=4, targets=targets))
        assert s.base == total_params(shape) == sum(p.numel() for p in tiny().parameters())
        assert s.trainable == lora_trainable_params(shape, 4, targets)
        assert s.quantized == quantized_params(shape, targets)
        assert s.quantized_bytes == nf4_weight_bytes(shape, False, targets)
        assert s.quantized_bytes * 16 == s.quantized * 9  # 4-bit codes + an fp32 absmax per 64: 0.5625 byte each
        assert s.all == s.base + s.trainable
    lines = []
    text = print_trainable_parameters(qlora(r=4), log=lines.append)
    s = param_summary(qlora(r=4))
    assert lines == [text]
    assert f"trainable params: {s.trainable:,} || all params: {s.all:,} || trainable%: " in text
    assert f"base params: {total_params(shape):,} (of which {quantized_params(shape):,} in nf4_per_group_64" in text


def test_adapter_keys_match_a_float_base_and_round_trip(tmp_path):
    model, ref = qlora(r=4), tiny()
    apply_lora(ref, __import__("minituner.lora", fromlist=["LoRAConfig"]).LoRAConfig(r=4))
    assert lora_state_dict(model).keys() == lora_state_dict(ref).keys()
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B["default"].weight.normal_()
    save_adapter(model, tmp_path / "a.safetensors")
    fresh = qlora(r=4)
    load_adapter(fresh, tmp_path / "a.safetensors", adapter_name="loaded")
    x = tokens()
    from minituner.zoo import set_adapter

    set_adapter(fresh, "loaded")
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    check_qlora(fresh)


def test_guards_name_the_path_that_went_non_finite():
    model, x = qlora(r=4), tokens()
    q = model.blocks[0].attn.q_proj
    with torch.no_grad():
        q.lora_B["default"].weight.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match=r"blocks\.0\.attn\.q_proj: .*the LoRA path"):
        model(x)
    model = qlora(r=4)
    model.blocks[1].mlp.fc2.base_layer.weight_absmax[0] = float("nan")
    with pytest.raises(QuantizationError, match="NaN/Inf"):  # the dequant path refuses before any matmul
        model(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_guard_passes_finite_outputs_whose_sum_overflows_and_stops_nan_and_inf(dtype):
    """The guard sums the output once (bf16 in its own dtype, fp16 in fp32); a sum that overflows while every
    value is finite passes, a single NaN or inf stops the forward."""
    from minituner.qlora import _guard
    layer = LoRALinear(nn.Linear(4, 4, dtype=dtype), r=2, alpha=4.0)
    x = torch.ones(2, 4, dtype=dtype)
    big = torch.full((64, 4), torch.finfo(dtype).max / 2, dtype=dtype)
    assert torch.isfinite(big).all()
    if dtype != torch.float16:  # the sum the guard takes overflows: the second look decides
        assert not torch.isfinite(big.sum())
    _guard("l", layer, (x,), {}, big)  # finite values: no error
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.zeros(2, 4, dtype=dtype)
        y[1, 3] = bad
        with pytest.raises(FloatingPointError, match="l: non-finite output"):
            _guard("l", layer, (x,), {}, y)


def test_compute_dtype_casts_the_float_parts_but_not_the_quantized_weights_or_lora():
    ref, model = qlora(r=4), qlora(r=4, compute_dtype=torch.bfloat16)
    assert model.wte.weight.dtype == model.blocks[0].ln_1.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.wte.weight  # still tied
    for (path, a), b in zip(quantized_modules(model).items(), quantized_modules(ref).values()):
        assert a.bias.dtype == torch.bfloat16
        assert all(torch.equal(s, t) for s, t in zip(a.quantized_tensors(), b.quantized_tensors())), path
        assert a.weight_absmax.dtype == torch.float32
    assert all(m.lora_A["default"].weight.dtype == torch.float32 for m in lora_modules(model).values())
    x = tokens()
    with torch.no_grad():
        y = model(x)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        assert compare_logits(ref(x), y)["ratio"] < 0.05
    lm_loss(model, x[:, :-1], x[:, 1:]).backward()
    check_qlora(model)


def test_weight_errors_match_dequantize():
    fp, model = tiny(), qlora(r=4)
    errs = weight_errors(fp, model)
    assert set(errs) == set(lora_modules(model))
    w = fp.blocks[0].mlp.fc1.weight.detach()
    expected = float((model.blocks[0].mlp.fc1.base_layer.dequantize() - w).norm() / w.norm())
    assert errs["blocks.0.mlp.fc1"] == pytest.approx(expected)
    assert all(0.01 < e < 0.2 for e in errs.values())  # NF4: about 9% of the weight's norm


def test_compare_logits_by_hand():
    ref = torch.tensor([[[1.0, -3.0], [2.0, 0.0]]])
    other = torch.tensor([[[1.5, -3.0], [-1.0, 0.0]]])
    d = compare_logits(ref, other)
    assert d["mean_abs_diff"] == pytest.approx(3.5 / 4) and d["mean_abs_ref"] == pytest.approx(6 / 4)
    assert d["ratio"] == pytest.approx(3.5 / 6) and d["max_abs_diff"] == 3.0 and d["top1_agreement"] == 0.5


def test_bad_input_is_refused_before_anything_changes():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match="rank"):
        wrap_minigpt_qlora(model, r=64, device="cpu")  # exceeds min(in, out) = 32
    with pytest.raises(InputError, match="unknown quantization scheme"):
        wrap_minigpt_qlora(model, quant_scheme="nf3", device="cpu")
    with pytest.raises(InputError, match="unknown LoRA target"):
        wrap_minigpt_qlora(model, targets="c_attn", device="cpu")
    assert not lora_modules(model) and not quantized_modules(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    wrap_minigpt_qlora(model, device="cpu")
    with pytest.raises(InputError, match="float base"):
        wrap_minigpt_qlora(model, device="cpu")


def test_check_qlora_catches_a_trainable_base_parameter():
    model = qlora(r=4)
    model.wte.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="wte.weight"):
        check_qlora(model)


def test_default_device():
    assert training_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_bf16_compute():
    model = wrap_minigpt_qlora(tiny(), r=4)
    assert model.wte.weight.device.type == "cuda" and model.wte.weight.dtype == torch.bfloat16
    assert isinstance(model.blocks[0].attn.q_proj, LoRALinear)
    x = tokens().cuda()
    loss = lm_loss(model, x[:, :-1], x[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].attn.q_proj.lora_B["default"].weight.grad is not None

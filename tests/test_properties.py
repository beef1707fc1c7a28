"""Property tests (hypothesis) for the promises the rest of minituner builds on.

Here: NF4's round-trip bound for any shape, scale and block size; LoRA merge/unmerge round trips on any
layer shape, rank and scaling; the planner's LoRA count equals what apply_lora instantiates, for random
small MiniGPT configs, ranks and target sets. Properties that already live beside their module, and are
not repeated here:
  - NF4 pack/unpack identity: tests/miniquant/test_nf4.py::test_pack_unpack_identity
  - symmetric per-group int8/int4 bounds (|code| <= qmax, error <= scale/2):
    tests/miniquant/test_int_quant.py::test_codes_scales_and_bound_hypothesis
  - planner parameter counts (per kind) equal the instantiated model:
    tests/minituner/test_planner_counts.py::test_random_minigpt_configs_equal_the_model and
    tests/minituner/test_planner_hf.py (gpt2, llama, mistral, qwen2 configs against transformers)
"""
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from miniquant import dequantize_nf4, nf4_code_table, quantize_nf4
from minigpt.model import GPTConfig, MiniGPT
from minituner.lora import LoRAConfig, LoRALinear, apply_lora, trainable_numel
from minituner.planner import lora_trainable_params, minigpt_shape

CODE = nf4_code_table()
HALF_GAP = float((CODE[1:] - CODE[:-1]).max()) / 2  # 0.1385, between the codes 0.7230 and 1.0
EPS32 = torch.finfo(torch.float32).eps


def assert_nf4_bound(w: torch.Tensor, blocksize: int) -> None:
    """|dequantize(quantize(w)) - w| <= absmax of the value's block x half the largest gap between codes."""
    q = quantize_nf4(w, blocksize=blocksize)
    err = (dequantize_nf4(q, torch.float32) - w.float()).abs().reshape(-1)
    bound = q.absmax.repeat_interleave(blocksize)[: w.numel()] * HALF_GAP
    assert torch.all(err <= bound * (1 + 1e-6)), float((err - bound).max())


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    log2_scale=st.integers(-100, 100),  # |w| from ~1e-31 to ~1e31: far from bitsandbytes' absmax floor 1e-38
    blocksize=st.sampled_from([16, 64, 128, 256]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nf4_round_trip_bound_for_any_shape_and_scale(shape, log2_scale, blocksize, dtype, seed):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2.0**log2_scale
    if dtype == torch.float16:
        w = w.clamp(-60000, 60000)  # float16's range; the scale still varies below it
    assert_nf4_bound(w.to(dtype), blocksize)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(-2.0**100, 2.0**100, allow_nan=False, allow_subnormal=False, width=32), min_size=1,
                    max_size=300),
    blocksize=st.sampled_from([1, 7, 64]),
)
def test_nf4_round_trip_bound_for_any_values(values, blocksize):
    """Zeros, ties, one outlier per block, values exactly between two codes: whatever hypothesis finds."""
    assert_nf4_bound(torch.tensor(values, dtype=torch.float32), blocksize)


@settings(max_examples=60, deadline=None)
@given(
    d_in=st.integers(1, 24), d_out=st.integers(1, 24), r_frac=st.floats(0, 1), alpha=st.floats(0.01, 64),
    use_rslora=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_lora_merge_unmerge_round_trip(d_in, d_out, r_frac, alpha, use_rslora, bias, seed):
    torch.manual_seed(seed)
    r = 1 + int(r_frac * (min(d_in, d_out) - 1))
    layer = LoRALinear(nn.Linear(d_in, d_out, bias=bias), r=r, alpha=alpha, use_rslora=use_rslora)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # B = 0 at init would make every check trivial
    x = torch.randn(5, d_in)
    w0 = layer.base_layer.weight.detach().clone()
    s, B, A = layer.scaling["default"], layer.lora_B["default"].weight.detach(), layer.lora_A["default"].weight.detach()
    delta = s * B @ A
    tol = (r + 4) * EPS32 * (w0.abs() + s * B.abs() @ A.abs())  # float32 rounding of W + s·B·A, summed over r
    with torch.no_grad():
        y = layer(x)
        layer.merge()
        merged = layer.base_layer.weight.detach().clone()
        assert torch.all((merged - (w0 + delta)).abs() <= tol)
        torch.testing.assert_close(layer(x), y, rtol=1e-4, atol=1e-4 * (1 + float(y.abs().max())))
        layer.merge()  # idempotent: nothing added twice
        assert torch.equal(layer.base_layer.weight, merged)
        layer.unmerge()
        layer.unmerge()
        assert torch.all((layer.base_layer.weight - w0).abs() <= tol)  # W + ΔW - ΔW = W up to rounding
        torch.testing.assert_close(layer(x), y, rtol=1e-4, atol=1e-4 * (1 + float(y.abs().max())))
        assert torch.equal(layer.merged_linear().weight, merged)  # the out-of-place merge is the same sum


@st.composite
def minigpt_with_lora(draw):
    n_head = draw(st.integers(1, 3))
    d_model = n_head * draw(st.integers(1, 6))
    cfg = GPTConfig(vocab_size=draw(st.integers(1, 30)), block_size=draw(st.integers(1, 16)),
                    n_layer=draw(st.integers(1, 3)), n_head=n_head, d_model=d_model,
                    d_ff=draw(st.integers(0, 20)), bias=draw(st.booleans()), tie_weights=draw(st.booleans()))
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]
    targets = draw(st.one_of(st.just("all-linear"), st.lists(st.sampled_from(names), min_size=1, unique=True)))
    r = draw(st.integers(1, min(cfg.d_model, cfg.d_ff)))
    return cfg, r, targets if isinstance(targets, str) else ",".join(targets)


@settings(max_examples=40, deadline=None)
@given(case=minigpt_with_lora())
def test_planner_lora_count_equals_apply_lora(case):
    cfg, r, targets = case
    model = MiniGPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRAConfig(r=r, target_modules=targets))
    assert trainable_numel(model) == lora_trainable_params(minigpt_shape(cfg), r, targets)
    assert sum(p.numel() for p in model.parameters()) - trainable_numel(model) == total  # base unchanged

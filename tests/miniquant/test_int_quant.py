"""Phase 26 symmetric per-group int8/int4 quantization."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import miniquant.int_quant as iq
from miniquant import QuantizationError, dequantize_symmetric_per_group, quantize_symmetric_per_group


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,group", [((48, 64), 32), ((48, 64), 64), ((10, 50), 16), ((7,), 3), ((2, 3, 20), 8)])
def test_round_trip_error_at_most_half_a_step(bits, shape, group):
    torch.manual_seed(0)
    w = torch.randn(shape)
    q = quantize_symmetric_per_group(w, bits, group)
    d = dequantize_symmetric_per_group(q)
    assert d.shape == w.shape and d.dtype == w.dtype
    cols = shape[-1]
    step = q.scales.repeat_interleave(group, dim=1)[:, :cols].reshape(shape)  # each value's scale
    assert torch.all((d - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7)


@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 70),
    group=st.integers(1, 80),
    bits=st.sampled_from([8, 4]),
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.integers(-20, 20),
)
@settings(max_examples=60, deadline=None)
def test_codes_scales_and_bound_hypothesis(rows, cols, group, bits, seed, log_scale):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    q = quantize_symmetric_per_group(w, bits, group)
    codes = iq.unpack_int_codes(q)
    qmax = iq.qmax(bits)
    assert codes.abs().max() <= qmax
    groups = -(-cols // group)
    assert q.scales.shape == (rows, groups)
    padded = torch.nn.functional.pad(w, (0, groups * group - cols)).view(rows, groups, group)
    assert torch.allclose(q.scales, padded.abs().amax(-1) / qmax, rtol=0, atol=0)
    step = q.scales.repeat_interleave(group, dim=1)[:, :cols]
    assert torch.all((dequantize_symmetric_per_group(q) - w).abs() <= step / 2 * (1 + 1e-5))


def test_largest_value_of_each_group_is_exact_code_qmax():
    w = torch.tensor([[0.5, -2.0, 1.0, 0.25]])
    q = quantize_symmetric_per_group(w, 8, 4)
    assert iq.unpack_int_codes(q).tolist() == [[32, -127, 64, 16]]
    assert float(dequantize_symmetric_per_group(q)[0, 1]) == -2.0


def test_all_zero_group_gives_zero_scale_and_zeros():
    w = torch.randn(4, 16)
    w[:, :8] = 0
    for bits in (8, 4):
        q = quantize_symmetric_per_group(w, bits, 8)
        assert torch.all(q.scales[:, 0] == 0)
        d = dequantize_symmetric_per_group(q)
        assert torch.isfinite(d).all() and torch.all(d[:, :8] == 0)


def test_int4_packing_and_exact_storage():
    w = torch.randn(5, 7)  # 35 values: odd count
    q4 = quantize_symmetric_per_group(w, 4, 4)
    assert q4.qweight.dtype == torch.uint8 and q4.qweight.shape == (18,)
    assert q4.nbytes == 18 + 5 * 2 * 4
    q8 = quantize_symmetric_per_group(w, 8, 4)
    assert q8.qweight.dtype == torch.int8 and q8.qweight.shape == (5, 7)
    assert q8.nbytes == 35 + 5 * 2 * 4
    assert torch.all(q4.qweight >> 4 >= 1)  # codes stored as q + 8 in [1, 15]


def test_int8_more_accurate_than_int4():
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    errs = {}
    for b in (8, 4):
        d = dequantize_symmetric_per_group(quantize_symmetric_per_group(w, b, 32))
        errs[b] = float((d - w).abs().mean() / w.abs().mean())
    print(f"mean relative error, group 32: int8 {errs[8]:.4f}, int4 {errs[4]:.4f}")
    assert errs[8] < 0.01 < errs[4] < 0.15


def test_chunking_does_not_change_results(monkeypatch):
    torch.manual_seed(2)
    w = torch.randn(33, 40)
    a = quantize_symmetric_per_group(w, 4, 16)
    monkeypatch.setattr(iq, "CHUNK_ELEMENTS", 50)  # one row per chunk
    b = quantize_symmetric_per_group(w, 4, 16)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert torch.equal(dequantize_symmetric_per_group(a), dequantize_symmetric_per_group(b))


def test_low_precision_inputs_and_output_dtype():
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    q = quantize_symmetric_per_group(w, 8, 32)
    assert dequantize_symmetric_per_group(q).dtype == torch.bfloat16
    assert dequantize_symmetric_per_group(q, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_raise_value_error(bad):
    w = torch.randn(4, 8)
    w[2, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_symmetric_per_group(w, 8, 4)


@pytest.mark.parametrize("bits,group", [(3, 8), (16, 8), (8, 0), (8, -1), (8, 2.5)])
def test_bad_arguments_raise(bits, group):
    with pytest.raises(QuantizationError):
        quantize_symmetric_per_group(torch.randn(4, 8), bits, group)


def test_non_float_input_raises():
    with pytest.raises(QuantizationError):
        quantize_symmetric_per_group(torch.ones(4, 8, dtype=torch.int32), 8, 4)

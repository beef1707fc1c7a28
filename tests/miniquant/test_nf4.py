"""NF4 on its own: code table, packing, lookup, round-trip bounds, edge cases, chunking, storage."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import miniquant.nf4 as nf4
from miniquant import QuantizationError, dequantize_nf4, nf4_code_table, pack_nibbles, quantize_nf4, unpack_nibbles


def test_code_table_shape_zero_and_range():
    code = nf4_code_table()
    assert code.dtype == torch.float32 and code.shape == (16,)
    assert torch.all(code[1:] > code[:-1])
    assert code[0] == -1.0 and code[15] == 1.0
    assert code[nf4.NF4_ZERO_CODE] == 0.0  # exact zero: padding and all-zero blocks stay zero
    assert int((code > 0).sum()) == 8 and int((code < 0).sum()) == 7  # the extra positive value


def test_code_table_values_are_normal_quantiles():
    # Positive codes: ndtri of 8 evenly spaced probabilities from 0.9677083 towards 0.5, over ndtri(0.9677083).
    top = torch.special.ndtri(torch.tensor(nf4.NF4_OFFSET, dtype=torch.float64))
    p = torch.linspace(nf4.NF4_OFFSET, 0.5, 9)[:-1].double()
    expected = (torch.special.ndtri(p) / top).flip(0)
    assert torch.allclose(nf4_code_table()[8:].double(), expected, atol=1e-7)


@given(st.lists(st.integers(0, 15), min_size=0, max_size=301))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_identity(codes):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_nibbles(t)
    assert packed.shape == (math.ceil(len(codes) / 2),)
    assert torch.equal(unpack_nibbles(packed, len(codes)), t)


def test_pack_puts_first_code_in_high_nibble_and_pads():
    assert pack_nibbles(torch.tensor([1, 2, 3]), pad=7).tolist() == [0x12, 0x37]


def _adversarial_unit_values() -> torch.Tensor:
    """Every midpoint and code value, their float32 neighbours, and dense random values in [-1, 1]."""
    mids, code = nf4.nf4_midpoints(), nf4_code_table()
    special = torch.cat([mids, code, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    up = torch.nextafter(special, torch.full_like(special, 2.0))
    down = torch.nextafter(special, torch.full_like(special, -2.0))
    cells = torch.arange(-64, 65, dtype=torch.float32) / 64  # the lookup's cell edges
    cells = torch.cat([cells, torch.nextafter(cells, cells + 1), torch.nextafter(cells, cells - 1)])
    dense = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return torch.cat([special, up, down, cells, dense]).clamp(-1, 1)


def test_fast_lookup_equals_bucketize_reference():
    v = _adversarial_unit_values()
    assert torch.equal(nf4.nearest_nf4_code(v), nf4.nearest_nf4_code_reference(v))


def test_midpoint_takes_lower_code_and_code_values_map_to_themselves():
    mids = nf4.nf4_midpoints()
    assert nf4.nearest_nf4_code(mids).tolist() == list(range(15))
    assert nf4.nearest_nf4_code(nf4_code_table()).tolist() == list(range(16))


def _max_half_gap() -> float:
    code = nf4_code_table()
    return float((code[1:] - code[:-1]).max()) / 2  # 0.1385: between 0.7230 and 1.0


@pytest.mark.parametrize("shape", [(64, 64), (33, 17), (1000,), (2, 3, 41)])
def test_round_trip_error_within_half_largest_gap(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    q = quantize_nf4(w)
    err = (dequantize_nf4(q) - w).abs().reshape(-1)
    bound = q.absmax.repeat_interleave(64)[: w.numel()] * _max_half_gap()
    assert torch.all(err <= bound * (1 + 1e-6))


def test_relative_error_on_random_normal_matrix():
    torch.manual_seed(0)
    w = torch.randn(512, 512)
    rel = float((dequantize_nf4(quantize_nf4(w)) - w).abs().mean() / w.abs().mean())
    print(f"NF4 mean relative error on a 512x512 N(0,1) matrix: {rel:.4f}")
    assert 0.05 < rel < 0.12  # ~0.09 expected for 4-bit codes on normal data


def test_all_zero_block_dequantizes_to_zero():
    w = torch.randn(3, 64)
    w[1] = 0.0
    w[2, :5] = -0.0
    q = quantize_nf4(w)
    assert q.absmax[1] == 0.0
    d = dequantize_nf4(q)
    assert torch.isfinite(d).all() and torch.equal(d[1], torch.zeros(64))
    assert torch.all(d[2, :5] == 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_inf_raise_value_error(bad, dtype):
    w = torch.randn(10, 13).to(dtype)
    w[7, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nf4(w)


def test_bad_inputs_raise():
    with pytest.raises(QuantizationError):
        quantize_nf4(torch.randn(8, dtype=torch.float64))
    with pytest.raises(QuantizationError):
        quantize_nf4(torch.zeros(0))
    with pytest.raises(QuantizationError):
        quantize_nf4(torch.randn(8), blocksize=0)


def test_chunking_does_not_change_results(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(37, 91)  # 3367 values: partial last block, odd count
    whole = quantize_nf4(w)
    monkeypatch.setattr(nf4, "CHUNK_ELEMENTS", 128)  # 2 blocks per chunk, many chunks
    chunked = quantize_nf4(w)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(whole.absmax, chunked.absmax)
    assert torch.equal(dequantize_nf4(whole), dequantize_nf4(chunked))


def test_contract_fields_and_exact_storage():
    w = torch.randn(7, 9, dtype=torch.bfloat16)  # 63 values: one partial block, odd count
    q = quantize_nf4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (32,)
    assert q.absmax.dtype == torch.float32 and q.absmax.shape == (1,)
    assert q.shape == w.shape and q.dtype == torch.bfloat16 and q.blocksize == 64
    assert q.nbytes == 32 + 4
    assert (q.packed[-1] & 0xF) == nf4.NF4_ZERO_CODE  # padding nibble holds the code of 0.0
    assert dequantize_nf4(q).dtype == torch.bfloat16
    assert dequantize_nf4(q, torch.float32).dtype == torch.float32


def test_double_quant_round_trip_and_storage():
    torch.manual_seed(2)
    w = torch.randn(256, 130)  # 33280 values -> 520 blocks -> 3 double-quant blocks (last partial)
    q, dq = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    assert torch.equal(q.packed, dq.packed)
    assert dq.absmax.dtype == torch.uint8 and dq.absmax.shape == (520,)
    assert dq.absmax_scale.shape == (3,) and dq.absmax_offset.shape == ()
    assert dq.nbytes == 16640 + 520 + 3 * 4 + 4
    assert q.nbytes == 16640 + 520 * 4
    rel = (dq.block_scales() - q.absmax).abs().max() / q.absmax.max()
    assert rel < 0.01  # absmax survives 8-bit dynamic quantization to within 1%
    e_single = (dequantize_nf4(q) - w).abs().mean()
    e_double = (dequantize_nf4(dq) - w).abs().mean()
    assert e_double < e_single * 1.05

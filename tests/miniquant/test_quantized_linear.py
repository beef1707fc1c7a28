"""QuantizedLinear: schemes, buffers only, output close to nn.Linear, grad for x only, state_dict round trip."""
import pytest
import torch
from torch import nn

from miniquant import QuantizationError, QuantizedLinear, dequantize_nf4, nf4_code_table, parse_scheme, quantize_nf4
from miniquant.int_quant import dequantize_symmetric_per_group, quantize_symmetric_per_group

SCHEMES = ["int8_per_group_32", "int4_per_group_32", "nf4_per_group_64", "int4_per_group_24"]


def make_linear(in_f=64, out_f=48, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def test_parse_scheme():
    assert parse_scheme("int8_per_group_128").group_size == 128
    assert parse_scheme("int4_per_group_7").kind == "int4"
    assert parse_scheme("nf4_per_group_64").name == "nf4_per_group_64"
    for bad in ["nf4", "int2_per_group_64", "int8_per_group_0", "nf4_per_group_48", "int8_per_group_64 ", None]:
        with pytest.raises(ValueError, match="valid: int8_per_group_<G>"):
            parse_scheme(bad)


def test_unknown_scheme_in_from_linear_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'fp8'.*nf4_per_group_<G>"):
        QuantizedLinear.from_linear(make_linear(), "fp8")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_buffers_only_and_attributes(scheme):
    lin = make_linear()
    q = QuantizedLinear.from_linear(lin, scheme)
    assert list(q.parameters()) == []
    assert q.in_features == 64 and q.out_features == 48 and q.scheme == scheme
    assert torch.equal(q.bias, lin.bias.detach()) and not q.bias.requires_grad
    assert all(not b.requires_grad for b in q.buffers())
    assert q.dequantize().shape == (48, 64) and q.dequantize().dtype == torch.float32
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_matches_the_pure_functions_and_storage_is_exact():
    lin = make_linear()
    w = lin.weight.detach()
    q = QuantizedLinear.from_linear(lin, "nf4_per_group_64")
    assert torch.equal(q.dequantize(), dequantize_nf4(quantize_nf4(w, 64)))
    assert q.storage_bytes() == 48 * 64 // 2 + (48 * 64 // 64) * 4
    q8 = QuantizedLinear.from_linear(lin, "int8_per_group_32")
    assert torch.equal(q8.dequantize(), dequantize_symmetric_per_group(quantize_symmetric_per_group(w, 8, 32)))
    assert q8.storage_bytes() == 48 * 64 + 48 * 2 * 4
    q4 = QuantizedLinear.from_linear(lin, "int4_per_group_24")
    assert q4.storage_bytes() == 48 * 64 // 2 + 48 * 3 * 4  # 64 = 24 + 24 + 16: three groups per row
    assert q4.storage_bytes() < q8.storage_bytes() < w.numel() * 4


def _per_weight_error_bound(q: QuantizedLinear) -> torch.Tensor:
    """(out, in) bound on |W - W_q| for each weight: half a quantization step."""
    s = parse_scheme(q.scheme)
    if s.kind == "nf4":
        code = nf4_code_table()
        half_gap = float((code[1:] - code[:-1]).max()) / 2
        return (q.weight_absmax.repeat_interleave(s.group_size)[: 48 * 64] * half_gap).view(48, 64)
    return q.weight_scale.repeat_interleave(s.group_size, dim=1)[:, :64] / 2


@pytest.mark.parametrize("scheme", SCHEMES)
def test_output_close_to_linear(scheme):
    """|y_q - y| <= sum_j |x_j| * bound_ij (plus float slack), and the mean relative error is small."""
    lin = make_linear()
    q = QuantizedLinear.from_linear(lin, scheme)
    x = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, y_ref = q(x), lin(x)
    assert y.shape == (4, 5, 48)
    bound = x.abs() @ _per_weight_error_bound(q).T  # (4, 5, 48)
    assert torch.all((y - y_ref).abs() <= bound * (1 + 1e-4) + 1e-5)
    assert torch.allclose(y, x @ q.dequantize().T + q.bias, atol=1e-5, rtol=1e-5)
    rel = float((y - y_ref).abs().mean() / y_ref.abs().mean())
    tolerance = 0.01 if scheme.startswith("int8") else 0.15  # stated tolerance per code width
    print(f"{scheme}: mean relative output error {rel:.4f} (tolerance {tolerance})")
    assert rel < tolerance


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gradient_reaches_x_only(scheme):
    lin = make_linear()
    q = QuantizedLinear.from_linear(lin, scheme)
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 48)
    q(x).backward(g)
    assert torch.allclose(x.grad, g @ q.dequantize(), atol=1e-5)
    assert all(b.grad is None for b in q.buffers())


def test_backward_saves_only_the_quantized_buffers():
    """Nothing dequantized is kept for backward: every saved tensor is one of the layer's buffers."""
    q = QuantizedLinear.from_linear(make_linear(), "nf4_per_group_64")
    saved = []
    x = torch.randn(3, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = q(x)
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {q.weight_packed.data_ptr(), q.weight_absmax.data_ptr()}
    y.sum().backward()
    assert x.grad is not None


def test_modifying_buffers_between_forward_and_backward_is_caught():
    q = QuantizedLinear.from_linear(make_linear(), "int8_per_group_32")
    x = torch.randn(2, 64, requires_grad=True)
    y = q(x)
    q.weight_scale.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_in_input_dtype(dtype):
    lin = make_linear()
    q = QuantizedLinear.from_linear(lin, "nf4_per_group_64")
    x = torch.randn(2, 64).to(dtype).requires_grad_()
    y = q(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == dtype


def test_no_bias_and_low_precision_linear():
    lin = make_linear(bias=False).to(torch.bfloat16)
    q = QuantizedLinear.from_linear(lin, "nf4_per_group_64")
    assert q.bias is None and q.weight_dtype == torch.bfloat16
    assert q.dequantize().dtype == torch.bfloat16
    # NF4 of a bf16 weight is the same bytes bitsandbytes would produce for it
    assert torch.equal(q.weight_packed, quantize_nf4(lin.weight.detach()).packed)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_state_dict_round_trip_through_safetensors(scheme, tmp_path):
    from safetensors.torch import load_file, save_file

    q = QuantizedLinear.from_linear(make_linear(), scheme)
    save_file(q.state_dict(), str(tmp_path / "q.safetensors"))
    fresh = QuantizedLinear(64, 48, scheme, bias=True)
    fresh.load_state_dict(load_file(str(tmp_path / "q.safetensors")))
    for name, buf in q.named_buffers():
        assert torch.equal(buf, getattr(fresh, name)), name
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), q(x))


def test_non_finite_dequantized_weight_is_caught():
    q = QuantizedLinear.from_linear(make_linear(), "nf4_per_group_64")
    q.weight_absmax[3] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        q(torch.randn(2, 64))


@pytest.mark.parametrize("write", ["in place", "through .data"])
def test_scales_written_after_a_good_forward_are_seen(write):
    """The scales are looked at on every dequantization: a NaN written after a good call is caught, however written."""
    q = QuantizedLinear.from_linear(make_linear(), "nf4_per_group_64")
    x = torch.randn(2, 64)
    q(x)
    (q.weight_absmax if write == "in place" else q.weight_absmax.data)[3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        q(x)


def test_layer_built_and_run_under_inference_mode():
    with torch.inference_mode():
        q = QuantizedLinear.from_linear(make_linear(), "nf4_per_group_64")
        assert torch.isfinite(q(torch.randn(2, 64))).all() and q.dequantize().shape == (48, 64)


@pytest.mark.parametrize("size", [(48, 64), (512, 256)])  # the eager dequantization path and the native one
def test_a_layer_first_run_under_inference_mode_then_trains(size):
    """The shared dequantization workspace is made a normal tensor even under inference_mode, so a forward with grad
    afterwards can write into it (an inference tensor refuses in-place writes outside inference_mode)."""
    from miniquant.quantize import release_workspace

    release_workspace()
    q = QuantizedLinear.from_linear(make_linear(size[1], size[0]), "nf4_per_group_64")  # size (out, in)
    x = torch.randn(3, size[1])
    with torch.inference_mode():
        ref = q(x)
    x.requires_grad_()
    q(x).sum().backward()
    assert torch.equal(q(x).detach(), ref) and x.grad is not None


def test_fp16_overflow_is_caught():
    lin = make_linear()
    with torch.no_grad():
        lin.weight[0, 0] = 1e6
    q = QuantizedLinear.from_linear(lin, "int8_per_group_32")
    with pytest.raises(ValueError, match="NaN/Inf"):
        q(torch.randn(2, 64, dtype=torch.float16))


def test_bad_input_shape_and_nan_weight():
    q = QuantizedLinear.from_linear(make_linear(), "int4_per_group_32")
    with pytest.raises(ValueError, match="last dimension 64"):
        q(torch.randn(2, 63))
    lin = make_linear()
    with torch.no_grad():
        lin.weight[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        QuantizedLinear.from_linear(lin, "nf4_per_group_64")

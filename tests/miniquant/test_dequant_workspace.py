"""Dequantizing into an existing tensor, the shared workspace of QuantizedLinear, and its compute dtype."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minikernels.fp32_gemm import linear
from miniquant import QuantizationError, QuantizedLinear, dequantize_nf4, nf4, quantize_nf4
from miniquant import quantize as qmod

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 96), (33, 17)], ids=str)  # whole blocks; a partial last block
def test_dequantize_into_out_equals_a_fresh_result(monkeypatch, native_path, dtype, shape):
    monkeypatch.setattr(nf4, "NATIVE_MIN_ELEMENTS", 1 if native_path else 1 << 62)
    q = quantize_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    out = torch.full((q.numel,), float("nan"), dtype=dtype)
    got = dequantize_nf4(q, dtype, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == shape
    assert torch.equal(got, dequantize_nf4(q, dtype))


def test_dequantize_out_of_the_wrong_kind_is_refused():
    q = quantize_nf4(torch.randn(8, 64))
    for bad in (torch.empty(8 * 64, dtype=torch.float16), torch.empty(8 * 64 + 1), torch.empty(64, 16).t()):
        with pytest.raises(QuantizationError, match="out must be"):
            dequantize_nf4(q, torch.float32 if bad.dtype != torch.float16 else torch.bfloat16, out=bad)


def _layers(seed=0):
    torch.manual_seed(seed)
    lins = [nn.Linear(64, 128), nn.Linear(128, 64)]
    return lins, [QuantizedLinear.from_linear(lin, "nf4_per_group_64") for lin in lins]


def test_layers_share_one_workspace_and_gradients_stay_right():
    """Two layers reuse one buffer in forward and backward; the gradients equal those of fresh dequantizations."""
    qmod.release_workspace()
    _, (q1, q2) = _layers()
    x = torch.randn(5, 64, requires_grad=True)
    y = q2(F.gelu(q1(x)))
    (y * torch.arange(64.0)).sum().backward()
    w1, w2 = q1.dequantize(), q2.dequantize()  # fresh tensors, not the workspace
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = linear(F.gelu(linear(x_ref, w1, q1.bias)), w2, q2.bias)  # the same product library (fp32_gemm)
    (y_ref * torch.arange(64.0)).sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    assert qmod.workspace_bytes() == 64 * 128 * 4  # one float32 buffer, as large as the largest layer
    ptr = qmod._workspace.get(1, torch.float32, torch.device("cpu")).data_ptr()
    q1(x)
    assert qmod._workspace.get(1, torch.float32, torch.device("cpu")).data_ptr() == ptr  # reused, not reallocated


def test_public_dequantize_returns_a_fresh_tensor():
    _, (q1, _) = _layers()
    a, b = q1.dequantize(), q1.dequantize()
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)


def test_compute_dtype_bf16_returns_the_input_dtype():
    _, (q1, _) = _layers()
    x = torch.randn(3, 7, 64, requires_grad=True)
    q1.compute_dtype = torch.bfloat16
    y = q1(x)
    assert y.dtype == torch.float32 and y.shape == (3, 7, 128)
    ref = F.linear(x.detach().bfloat16(), q1.dequantize(torch.bfloat16), q1.bias.bfloat16()).float()
    assert torch.equal(y, ref)
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert "compute_dtype=torch.bfloat16" in repr(q1)
    xb = x.detach().bfloat16()
    assert q1(xb).dtype == torch.bfloat16  # already in the compute dtype: no cast back


@pytest.mark.parametrize("threads", [1, 2])
def test_the_workspace_is_streamed_only_with_threads(monkeypatch, threads):
    """A transient bf16 weight is written into the workspace with non-temporal stores only where PyTorch runs more
    than one thread (the products then read the workspace on several cores; on one, normal stores are faster), and
    its values are the fresh dequantization's either way."""
    monkeypatch.setattr(nf4, "NATIVE_MIN_ELEMENTS", 1)
    asked = []
    monkeypatch.setattr(qmod, "dequantize_nf4", lambda *a, **k: asked.append(k["stream"]) or dequantize_nf4(*a, **k))
    _, (q1, _) = _layers()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = q1.dequantize_from(q1.quantized_tensors(), torch.bfloat16, transient=True).clone()
        fresh = q1.dequantize(torch.bfloat16)
    finally:
        torch.set_num_threads(previous)
    assert asked == [threads > 1, False]  # the transient weight, then the public (fresh) one
    assert torch.equal(w, fresh)

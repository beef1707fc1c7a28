"""minigpt.native_norm: the RMSNorm- and LayerNorm-to-bf16 kernels against PyTorch's ops on the same values."""
import pytest
import torch

from minigpt import native_norm
from minigpt.decoder import RMSNorm

kernels = native_norm.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler or no AVX-512: the norm kernels are not used")


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3.0
    weight = 1.0 + 0.1 * torch.randn(shape[-1], generator=g)
    grad_y = torch.randn(*shape, generator=g).to(torch.bfloat16)
    return x, weight, grad_y


def _reference(x, weight, grad_y, eps):
    """RMSNorm's PyTorch ops and the cast to bf16, forward and backward."""
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    xr = x.clone().requires_grad_()
    y = norm(xr).to(torch.bfloat16)
    y.backward(grad_y)
    return y, xr.grad


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 5, 16), (2, 7, 17), (3, 64), (1, 33, 2048), (4, 1)])  # each 16-lane tail
def test_forward_and_gradient_match_the_pytorch_ops(shape):
    x, weight, grad_y = _inputs(shape, seed=shape[-1])
    assert native_norm.fits(x, weight)
    xr = x.clone().requires_grad_()
    y = native_norm.rms_norm_bf16(xr, weight, 1e-5)
    y.backward(grad_y)
    y_ref, grad_ref = _reference(x, weight, grad_y, 1e-5)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # the same fp32 value up to the order of the sum of squares: at most one bf16 unit apart, almost always equal
    ulps = (y.view(torch.int16).int() - y_ref.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99
    assert xr.grad.dtype == torch.float32
    torch.testing.assert_close(xr.grad, grad_ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_row_with_nan_or_inf_is_nan_there_only():
    x, weight, grad_y = _inputs((3, 32))
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    y = native_norm.rms_norm_bf16(x, weight, 1e-6)
    y_ref, _ = _reference(x, weight, grad_y, 1e-6)
    assert torch.equal(y[0], y_ref[0])
    assert y[1].isnan().all() and y_ref[1].isnan().all()
    assert torch.equal(y[2].isnan(), y_ref[2].isnan())


def test_what_it_does_not_take():
    x, weight, _ = _inputs((2, 8))
    assert not native_norm.fits(x.to(torch.bfloat16), weight)  # the stream is fp32
    assert not native_norm.fits(x.t(), torch.ones(2))  # not contiguous
    assert not native_norm.fits(x, weight.clone().requires_grad_())  # a weight that trains
    assert not native_norm.fits(x, torch.ones(4))  # a weight of another width


@needs_kernels
def test_it_saves_what_the_pytorch_ops_save():
    """The stream tensor itself and one fp32 rstd per row (planner: rmsnorm input, rmsnorm rstd)."""
    x, weight, _ = _inputs((2, 6, 32))
    xr = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        native_norm.rms_norm_bf16(xr, weight, 1e-6)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved if t is not weight}
    assert storages == {xr.untyped_storage().data_ptr(): xr.nbytes,
                        next(p for p in storages if p != xr.untyped_storage().data_ptr()): 12 * 4}


def test_without_kernels_it_is_not_taken(monkeypatch):
    monkeypatch.setenv("MINIQUANT_NATIVE", "0")
    x, weight, _ = _inputs((2, 8))
    assert native_norm.kernels() is None and not native_norm.fits(x, weight)


def test_a_build_without_avx512_is_not_used(plain_build):
    """Without AVX-512 the row sums are one sequential chain in plain C: not used (PyTorch's ops run)."""
    lib = plain_build("bf16_norm_plain", native_norm)
    assert lib.norm_vectorized() == 0 and native_norm._usable(lib) is None


# ---- LayerNorm (MiniGPT, GPT-2): F.layer_norm and the cast to bf16 ------------------------------------------


def _layer_norm_reference(x, weight, bias, grad_y, eps):
    xr = x.clone().requires_grad_()
    y = torch.nn.functional.layer_norm(xr, x.shape[-1:], weight, bias, eps).to(torch.bfloat16)
    y.backward(grad_y)
    return y, xr.grad


@needs_kernels
@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
# each 16-lane tail (one value a row is left out: x - mean is 0 there, and PyTorch's gradient is rounding noise)
@pytest.mark.parametrize("shape", [(1, 5, 16), (2, 7, 17), (3, 64), (1, 33, 768), (4, 3)])
def test_layer_norm_forward_and_gradient_match_pytorch(shape, affine):
    x, weight, grad_y = _inputs(shape, seed=shape[-1])
    x = x + 2.0  # a mean away from 0
    bias = 0.1 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(5))
    weight, bias = (weight, bias) if affine == "weight and bias" else (weight, None) if affine == "weight" else (None, None)
    assert native_norm.layer_norm_fits(x, weight, bias)
    xr = x.clone().requires_grad_()
    y = native_norm.layer_norm_bf16(xr, weight, bias, 1e-5)
    y.backward(grad_y)
    y_ref, grad_ref = _layer_norm_reference(x, weight, bias, grad_y, 1e-5)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ulps = (y.view(torch.int16).int() - y_ref.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99  # the sums' order: rarely a bf16 unit apart
    assert xr.grad.dtype == torch.float32
    torch.testing.assert_close(xr.grad, grad_ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_layer_norm_a_row_with_nan_or_inf_is_nan_there_only():
    x, weight, grad_y = _inputs((3, 32))
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    y = native_norm.layer_norm_bf16(x, weight, None, 1e-5)
    y_ref, _ = _layer_norm_reference(x, weight, None, grad_y, 1e-5)
    assert torch.equal(y[0], y_ref[0])
    assert y[1].isnan().all() and y_ref[1].isnan().all()
    assert torch.equal(y[2].isnan(), y_ref[2].isnan())


def test_layer_norm_what_it_does_not_take():
    x, weight, _ = _inputs((2, 8))
    assert not native_norm.layer_norm_fits(x.to(torch.bfloat16), weight, None)  # the stream is fp32
    assert not native_norm.layer_norm_fits(x.t(), torch.ones(2), None)  # not contiguous
    assert not native_norm.layer_norm_fits(x, weight, torch.zeros(8, requires_grad=True))  # a bias that trains
    assert not native_norm.layer_norm_fits(x, None, torch.zeros(4))  # a bias of another width
    assert not native_norm.layer_norm_fits(x, weight.to(torch.bfloat16), None)  # a bf16 weight


@needs_kernels
def test_layer_norm_saves_what_pytorch_saves():
    """The stream tensor itself, one fp32 mean and one rstd per row (planner: layernorm input, layernorm mean/rstd)."""
    x, weight, _ = _inputs((2, 6, 32))
    xr = x.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        native_norm.layer_norm_bf16(xr, weight, torch.zeros(32), 1e-5)
    sizes = sorted(t.untyped_storage().nbytes() for t in saved if t is not weight)
    assert sizes == [12 * 4, 12 * 4, xr.nbytes] and any(t is xr for t in saved)


@needs_kernels
def test_bf16_compute_swaps_layer_norms_for_the_kernel():
    """use_bf16_compute: MiniGPT's LayerNorms hand out bf16 through the kernel, the same Parameters, the same values."""
    from minigpt.model import GPTConfig, MiniGPT
    from minituner.precision import Bf16OutLayerNorm, use_bf16_compute

    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=32)).requires_grad_(False)
    ln = model.blocks[0].ln_1
    weight = ln.weight
    x = torch.randn(2, 8, 32)
    expected = ln(x).to(torch.bfloat16)
    use_bf16_compute(model)
    swapped = model.blocks[0].ln_1
    assert type(swapped) is Bf16OutLayerNorm and swapped.weight is weight
    ulps = (swapped(x).view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert ulps.max() <= 1
    called = []
    real = native_norm.layer_norm_bf16
    native_norm.layer_norm_bf16 = lambda *a: called.append(1) or real(*a)
    try:
        swapped(x)
    finally:
        native_norm.layer_norm_bf16 = real
    assert called == [1]


# ---- the residual add fused in front of the norm (minigpt.residual.add_then_norm) ------------------------------


def _add_norm_case(shape, layer_norm, seed=0):
    x, weight, grad_y = _inputs(shape, seed)
    g = torch.Generator().manual_seed(seed + 1)
    branch = torch.randn(*shape, generator=g).to(torch.bfloat16)
    bias = 0.1 * torch.randn(shape[-1], generator=g) if layer_norm else None
    grad_sum = torch.randn(*shape, generator=g)
    return x, branch, weight, bias, grad_sum, grad_y


def _add_norm_run(fused, x, branch, weight, bias, grads, layer_norm):
    """(sum, y, x's gradient, the branch's gradient), fused or as the add followed by the norm's own kernel."""
    xr, br = x.clone().requires_grad_(), branch.clone().requires_grad_()
    if fused:
        s, y = (native_norm.add_layer_norm_bf16(xr, br, weight, bias, 1e-5) if layer_norm
                else native_norm.add_rms_norm_bf16(xr, br, weight, 1e-5))
    else:
        s = xr + br
        y = native_norm.layer_norm_bf16(s, weight, bias, 1e-5) if layer_norm else native_norm.rms_norm_bf16(s, weight, 1e-5)
    outs, gs = zip(*[(t, g) for t, g in zip((s, y), grads) if g is not None])
    torch.autograd.backward(outs, gs)
    return s.detach(), y.detach(), xr.grad, br.grad


@needs_kernels
@pytest.mark.parametrize("layer_norm", [True, False], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [(1, 5, 16), (2, 7, 17), (3, 64), (1, 33, 768)])  # each 16-lane tail
@pytest.mark.parametrize("used", ["both", "sum only", "norm only"])
def test_add_then_norm_gives_the_bits_of_the_add_and_the_norm(shape, layer_norm, used):
    """The sum, the norm of it, and both gradients are those of PyTorch's add followed by the norm's kernel, bit for
    bit, whichever of the two outputs the rest of the graph uses."""
    x, branch, weight, bias, grad_sum, grad_y = _add_norm_case(shape, layer_norm, seed=shape[-1])
    assert native_norm.add_fits(x, branch)
    grads = (grad_sum if used != "norm only" else None, grad_y if used != "sum only" else None)
    fused = _add_norm_run(True, x, branch, weight, bias, grads, layer_norm)
    unfused = _add_norm_run(False, x, branch, weight, bias, grads, layer_norm)
    assert [t.dtype for t in fused] == [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("layer_norm", [True, False], ids=["LayerNorm", "RMSNorm"])
def test_add_then_norm_nan_and_inf_as_the_unfused_ops(layer_norm):
    x, branch, weight, bias, grad_sum, grad_y = _add_norm_case((4, 32), layer_norm)
    x[1, 4] = float("nan")
    branch[2, 0] = float("inf")
    fused = _add_norm_run(True, x, branch, weight, bias, (grad_sum, grad_y), layer_norm)
    unfused = _add_norm_run(False, x, branch, weight, bias, (grad_sum, grad_y), layer_norm)
    for a, b in zip(fused, unfused):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
    assert fused[1][1].isnan().all() and not fused[1][0].isnan().any()


def test_add_fits_takes_a_bf16_branch_of_the_stream_shape():
    x, _, _ = _inputs((2, 8))
    branch = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert native_norm.add_fits(x, branch)
    assert not native_norm.add_fits(x, branch.float())  # an fp32 branch: the plain add
    assert not native_norm.add_fits(x, torch.zeros(8, 2, dtype=torch.bfloat16).t())  # not contiguous
    assert not native_norm.add_fits(x, torch.zeros(1, 8, dtype=torch.bfloat16))  # broadcast: the plain add


@needs_kernels
def test_add_then_norm_saves_what_the_norm_alone_saves():
    """The sum (the stream tensor the next add reads), one fp32 mean and one rstd per row; the add saves nothing."""
    x, branch, weight, bias, _, _ = _add_norm_case((2, 6, 32), True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        s, _ = native_norm.add_layer_norm_bf16(x.requires_grad_(), branch.requires_grad_(), weight, bias, 1e-5)
    sizes = sorted(t.untyped_storage().nbytes() for t in saved if t is not weight)
    assert sizes == [12 * 4, 12 * 4, s.nbytes] and any(t is s for t in saved)

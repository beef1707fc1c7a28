"""minikernels.fp32_gemm: the library choice, and products equal to F.linear's within fp32 rounding."""
import pytest
import torch
import torch.nn.functional as F

from minikernels import fp32_gemm
from minikernels.fp32_gemm import choose_backend, cpu_has_avx512, cpu_vendor, input_grad, linear, product

ONEDNN = fp32_gemm.onednn_available()


def test_vendor_is_read_from_cpuinfo():
    assert cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == "AuthenticAMD"
    assert cpu_vendor("processor : 0\nFeatures : fp asimd bf16\n") == ""  # Arm names no vendor_id


def test_avx512_is_read_from_cpuinfo():
    assert cpu_has_avx512("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n")
    assert not cpu_has_avx512("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert not cpu_has_avx512("processor : 0\nFeatures : fp asimd bf16\n")


@pytest.mark.parametrize("vendor, forced, available, avx512, expected", [
    ("AuthenticAMD", None, True, True, "onednn"),  # MKL would run its AVX2 kernels on this AVX-512 CPU
    ("HygonGenuine", "auto", True, True, "onednn"),
    ("AuthenticAMD", None, True, False, "aten"),  # AVX2 only: both libraries run AVX2, MKL the faster
    ("GenuineIntel", None, True, True, "aten"),  # MKL takes its AVX-512 kernels on Intel
    ("", None, True, False, "aten"),
    ("GenuineIntel", "onednn", True, True, "onednn"),
    ("AuthenticAMD", "onednn", True, False, "onednn"),
    ("AuthenticAMD", "aten", True, True, "aten"),
    ("AuthenticAMD", "onednn", False, True, "aten"),  # a build without oneDNN
])
def test_backend_choice(vendor, forced, available, avx512, expected):
    assert choose_backend(vendor, forced, available, avx512) == expected


def test_a_bad_forced_backend_is_named():
    with pytest.raises(ValueError, match="MINIKERNELS_FP32_GEMM.*'mkl'"):
        choose_backend("AuthenticAMD", "mkl", True, True)


@pytest.fixture(params=["onednn", "aten"])
def backend(request, monkeypatch):
    if request.param == "onednn" and not ONEDNN:
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(fp32_gemm, "backend", lambda: request.param)
    return request.param


def _close(a, b, scale):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_and_its_input_gradient_equal_f_linear(backend, shape, with_bias):
    torch.manual_seed(0)
    w = torch.randn(80, 48)
    b = torch.randn(80) if with_bias else None
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(*shape[:-1], 80)
    y, y_ref = linear(x, w, b), F.linear(x_ref, w, b)
    y.backward(g)
    y_ref.backward(g)
    _close(y, y_ref, 10)
    _close(x.grad, x_ref.grad, 10)
    _close(product(x.detach(), w, b), y_ref.detach(), 10)
    _close(input_grad(g, w), x_ref.grad, 10)


def test_non_contiguous_inputs(backend):
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    x = torch.randn(64, 24).t()  # (24, 64), transposed strides
    _close(linear(x, w), F.linear(x, w), 10)
    x = torch.randn(24, 128)[:, ::2]  # every other column
    _close(linear(x, w), F.linear(x, w), 10)


@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_trainable_weight_and_bias_gradients_equal_f_linear(backend, shape, with_bias, x_needs_grad):
    """Full fine-tuning: the weight's and the bias' gradients as F.linear's autograd gives them."""
    torch.manual_seed(2)
    w = torch.randn(80, 48, requires_grad=True)
    b = torch.randn(80, requires_grad=True) if with_bias else None
    x = torch.randn(*shape, requires_grad=x_needs_grad)
    g = torch.randn(*shape[:-1], 80)
    linear(x, w, b).backward(g)
    grads = [w.grad, None if b is None else b.grad, x.grad]
    w.grad = x.grad = None
    if b is not None:
        b.grad = None
    F.linear(x, w, b).backward(g)
    for got, ref in zip(grads, [w.grad, None if b is None else b.grad, x.grad]):
        assert (got is None) == (ref is None)
        if ref is not None:
            _close(got, ref, 10)


def test_a_trainable_product_keeps_what_f_linear_keeps(backend):
    """x for the weight's gradient, the weight for x's: references to the same storage F.linear keeps."""
    torch.manual_seed(3)
    w = torch.randn(16, 8, requires_grad=True)
    for x in (torch.randn(4, 8), torch.randn(4, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)):
        kept = {}
        for name, fn in (("ours", linear), ("F.linear", F.linear)):
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                fn(x, w)
            kept[name] = sorted(t.untyped_storage().data_ptr() for t in saved)
        assert kept["ours"] == kept["F.linear"]


def test_other_dtypes_take_f_linear(backend):
    xb, wb = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))  # bf16: F.linear itself


def test_autocast_and_an_empty_batch_behave_as_f_linear(backend):
    w, b = torch.randn(16, 8, requires_grad=True), torch.randn(16, requires_grad=True)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", torch.bfloat16):
        assert linear(x, w, b).dtype == F.linear(x, w, b).dtype == torch.bfloat16  # autocast's bf16, as nn.Linear
    empty = torch.randn(0, 8, requires_grad=True)
    y = linear(empty, w, b)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert empty.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))


def test_frozen_product_keeps_only_the_weight_for_backward(backend):
    """As F.linear does for a frozen weight: the weight is kept (no new memory), the input is not."""
    torch.manual_seed(3)
    w, x = torch.randn(16, 8), torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(x, w)
    assert [t.data_ptr() for t in saved] == [w.data_ptr()]


def test_no_graph_without_a_gradient_to_compute(backend):
    w, x = torch.randn(16, 8), torch.randn(4, 8)
    assert linear(x, w).grad_fn is None
    with torch.no_grad():
        assert linear(x.requires_grad_(True), w).grad_fn is None


def test_a_weight_gradient_copies_nothing(backend, monkeypatch):
    """oneDNN would copy grad_yᵀ (memory the planner does not count): the weight's gradient is torch.mm's."""
    calls = []
    real = fp32_gemm.onednn_linear
    monkeypatch.setattr(fp32_gemm, "onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    w, x = torch.randn(16, 8, requires_grad=True), torch.randn(6, 8)
    linear(x, w).sum().backward()
    assert calls == ([(6, 8)] if backend == "onednn" else [])  # the forward only
    _close(w.grad, torch.ones(6, 16).t() @ x, 10)


def test_onednn_takes_bf16_only_where_it_says_so(monkeypatch):
    """oneDNN's linear needs AVX-512 or AMX for bf16 (on an AVX2-only CPU it fails to create its kernel): where
    onednn_bf16_available says yes, a bf16 product with a bias runs and gives F.linear's bits; PyTorch's own
    answer, mocked to no, makes it no."""
    if fp32_gemm.onednn_bf16_available():
        x, w, b = (torch.randn(*s).bfloat16() for s in ((5, 24), (16, 24), (16,)))
        assert torch.equal(fp32_gemm.onednn_linear(x, w, b), F.linear(x, w, b))
    fp32_gemm.onednn_bf16_available.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    try:
        assert not fp32_gemm.onednn_bf16_available()
    finally:
        fp32_gemm.onednn_bf16_available.cache_clear()


def test_a_trainable_weight_gets_a_fresh_gradient_on_either_library(backend):
    """F.linear hands W's gradient on as a view (the transpose of a product), and a tied weight's second gradient
    then cannot be added into it in place (autograd makes a third vocab x d_model tensor); ours is a fresh one."""
    w = torch.randn(40, 8, requires_grad=True)
    x = torch.randn(2, 3, 8)
    views = []
    w.register_hook(lambda g: views.append(g._base is not None))
    F.linear(x, w).sum().backward()
    if not views[0]:
        pytest.skip("this PyTorch's F.linear hands on a fresh weight gradient")
    linear(x, w).sum().backward()
    assert views == [True, False]

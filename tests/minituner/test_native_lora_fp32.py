"""minituner.native_lora_fp32: the adapter's thin products in C (fp32), against fp64 references, on ragged shapes and
strided rows; the same bits on one thread or two; every value the forward writes looked at for NaN and inf; and a
LoRALinear through them (lora_product's fused Function) against its two pieces as PyTorch ops."""
import copy
import ctypes

import pytest
import torch
import torch.nn as nn

from miniquant import QuantizedLinear
from minikernels.build import build_library, find_compiler
from minituner import lora_product, native_lora, native_lora_fp32
from minituner.lora import LoRALinear

pytestmark = pytest.mark.skipif(native_lora_fp32.kernels() is None,
                                reason="minituner.native_lora_fp32 needs AVX2 with FMA (or AVX-512) and a C compiler")
K = native_lora_fp32.kernels()
SHAPES = [  # N, K (in), M (out), r: full vectors, every tail (K % 8, M % 32 and % 8, M % 16, odd N), r not a multiple
    (1024, 512, 512, 8), (7, 45, 33, 2), (33, 100, 70, 10), (5, 32, 64, 16), (1, 31, 17, 1), (130, 2048, 96, 3)]
EPS = 2.0**-24  # fp32's unit roundoff


def close(got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, terms: int) -> bool:
    """got (fp32) within the error bound of a sum of `terms` fp32 products in any order, γ·Σ|products| with
    γ = (terms + 2)·EPS: `magnitude` is that sum of absolute values (fp64), `ref` the exact result (fp64)."""
    return got.dtype == torch.float32 and bool(((got.double() - ref).abs() <= (terms + 2) * EPS * magnitude).all())


def operands(n, k, m, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k + 3, generator=g)[:, :k]  # rows with a stride of their own
    return (x, torch.randn(r, k, generator=g), torch.randn(m, r, generator=g), torch.randn(n, m, generator=g),
            torch.randn(n, m, generator=g))


@pytest.mark.parametrize("n, k, m, r", SHAPES)
def test_forward_backward_and_input_update_match_fp64(n, k, m, r):
    x, A, B, g, y0 = operands(n, k, m, r)
    xd, Ad, Bd, gd = x.double(), A.double(), B.double(), g.double()
    y = y0.clone()
    a, finite = K.forward_(y, x, A, B, 0.5)
    assert a.shape == (n, r) and finite is True
    assert close(a, xd @ Ad.t(), xd.abs() @ Ad.abs().t(), k)
    ad = a.double()
    assert close(y, y0.double() + 0.5 * ad @ Bd.t(), y0.double().abs() + 0.5 * ad.abs() @ Bd.abs().t(), r + 1)
    grad_a, grad_A, grad_B = K.backward(g, x, a, B, 0.5)
    assert close(grad_a, 0.5 * gd @ Bd, 0.5 * gd.abs() @ Bd.abs(), m)
    gad = grad_a.double()
    assert close(grad_A, gad.t() @ xd, gad.abs().t() @ xd.abs(), n)
    assert close(grad_B, 0.5 * gd.t() @ ad, 0.5 * gd.abs().t() @ ad.abs(), n)
    grad_x = x.contiguous()
    K.input_update_(grad_x, grad_a, A)
    assert close(grad_x, xd + gad @ Ad, xd.abs() + gad.abs() @ Ad.abs(), r + 1)


def test_only_what_is_asked_for():
    x, A, B, g, y0 = operands(64, 96, 80, 4)
    a, _ = K.forward_(y0.clone(), x, A, B, 1.0)
    grad_a, grad_A, grad_B = K.backward(g, x, a, B, 1.0)
    none_a, none_A, only_B = K.backward(g, x, a, B, 1.0, need_a=False, need_A=False)
    assert none_a is None and none_A is None and torch.equal(only_B, grad_B)
    ga, gA, none_B = K.backward(g, x, a, B, 1.0, need_B=False)
    assert none_B is None and torch.equal(ga, grad_a) and torch.equal(gA, grad_A)


def test_the_same_bits_on_one_thread_or_two():
    """Rows (forward, grad_a, the input's update) and columns (the masters' gradients) are split across threads, so
    every value is summed in one order whatever the split."""
    x, A, B, g, y0 = operands(1024, 512, 512, 8)

    def everything():
        y = y0.clone()
        a, _ = K.forward_(y, x, A, B, 2.0)
        grads = K.backward(g, x, a, B, 2.0)
        grad_x = x.contiguous()
        K.input_update_(grad_x, grads[0], A)
        return (y, a, *grads, grad_x)

    assert K._threads(1024 * 1024)[1] == min(2, torch.get_num_threads(), native_lora.CPU_COUNT) or not K._split.openmp
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = everything()
        torch.set_num_threads(2)
        two = everything()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(one, two))



@pytest.mark.parametrize("n, k, m, r", [(9, 40, 70, 10), (6, 32, 64, 8), (5, 16, 130, 3)])
def test_rows_in_pairs_give_the_bits_of_rows_one_at_a_time(n, k, m, r):
    """The update of y (forward) and of grad_x (input_update_) runs two rows at a time over whole blocks of columns,
    the rest (the last columns, an odd last row) one row at a time: one row per call takes only the second path."""
    x, A, B, _, y0 = operands(n, k, m, r)
    y = y0.clone()
    a, _ = K.forward_(y, x, A, B, 0.5)
    rows = [y0[i:i + 1].clone() for i in range(n)]
    for i, row in enumerate(rows):
        K.forward_(row, x[i:i + 1], A, B, 0.5)
    assert torch.equal(y, torch.cat(rows))
    grad_a = torch.randn(n, r, generator=torch.Generator().manual_seed(5))
    A_wide = torch.randn(r, m, generator=torch.Generator().manual_seed(6))  # the update's Bt: m columns
    grad_x = y0.clone()
    K.input_update_(grad_x, grad_a, A_wide)
    rows = [y0[i:i + 1].clone() for i in range(n)]
    for i, row in enumerate(rows):
        K.input_update_(row, grad_a[i:i + 1], A_wide)
    assert torch.equal(grad_x, torch.cat(rows))


def test_an_avx2_build_gives_the_bits_of_the_library_in_use(tmp_path, monkeypatch):
    """Built without AVX-512 (as on an AVX2 CPU) the updates' row pairs take blocks of 16 columns in 8-lane vectors,
    not 32 in 16 lanes: each value is the same chain of multiply-adds, so y's and grad_x's updates keep their bits."""
    monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
    try:
        path = build_library("lora_fp32_avx2", native_lora_fp32._SOURCE, native_lora_fp32.CFLAGS + ["-mno-avx512f"],
                             find_compiler(), ["-fopenmp"])
    except RuntimeError as e:
        pytest.skip(f"cannot build without AVX-512 here: {e}")
    avx2 = native_lora.NativeLoRA(ctypes.CDLL(str(path)), dtype=torch.float32)
    x, A, B, _, y0 = operands(67, 96, 100, 6)
    grad_a = torch.randn(67, 6, generator=torch.Generator().manual_seed(5))
    outputs = []
    for lib in (K, avx2):
        y, grad_x = y0.clone(), x.contiguous()
        a, _ = lib.forward_(y, x, A, B, 0.5)
        lib.input_update_(grad_x, grad_a, A)
        outputs.append((y, a, grad_x))
    assert all(torch.equal(p, q) for p, q in zip(*outputs))

@pytest.mark.parametrize("n, k, m, r", [(33, 100, 70, 10), (5, 32, 64, 1), (130, 64, 17, 2), (2048, 128, 136, 8)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_forward_reports_any_non_finite_value_it_writes(n, k, m, r, bad):
    """Whichever row and column (the 32-wide blocks, the 8-wide rest, the last ragged columns), on one thread or
    two; a NaN in x is carried into its row, as PyTorch's products carry it."""
    x, A, B, _, y0 = operands(n, k, m, r)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for row, col in [(0, 0), (n - 1, m - 1), (n // 2, m // 2), (n - 1, 31 % m), (0, (m - 1) // 8 * 8)]:
                y = y0.clone()
                y[row, col] = bad
                assert K.forward_(y, x, A, B, 0.5)[1] is False, (t, row, col)
                assert K.forward_(y0.clone(), x, A, B, 0.5)[1] is True
    finally:
        torch.set_num_threads(threads)
    x = x.clone()
    x[n // 2, 0] = float("nan")
    y = y0.clone()
    a, finite = K.forward_(y, x, A, B, 1.0)
    assert not finite and a[n // 2].isnan().all() and y[n // 2].isnan().all() and not y[n // 2 - 1].isnan().any()


def test_no_rows_give_zero_gradients():
    x, A, B, g, _ = operands(0, 64, 32, 2)
    _, grad_A, grad_B = K.backward(g, x, torch.empty(0, 2), B, 1.0)
    assert grad_A.shape == (2, 64) and not grad_A.any() and grad_B.shape == (32, 2) and not grad_B.any()


def test_fits_refuses_what_the_c_does_not_take():
    x, A, B = torch.randn(3, 64), torch.randn(4, 64), torch.randn(48, 4)
    assert native_lora_fp32.fits(x, A, B) and native_lora_fp32.fits(x, A[:3], B[:, :3].contiguous())  # any rank
    assert not native_lora_fp32.fits(x.to(torch.bfloat16), A, B)  # bf16 is native_lora's
    assert not native_lora_fp32.fits(x.double(), A, B)
    assert not native_lora_fp32.fits(x, A[:, :32], B)  # A's width is not x's
    assert not native_lora_fp32.fits(x, A, B[:, :2].contiguous())  # B's rank is not A's
    assert not native_lora_fp32.fits(x, A.t().contiguous().t(), B)  # a master that is a transposed view
    assert not native_lora_fp32.fits(x.t().contiguous().t(), A, B)  # x's rows not contiguous


def layer(base_kind: str) -> nn.Module:
    """A LoRALinear (r 4) in fp32 over an nn.Linear or an NF4 base, B nonzero, the base frozen."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    base = linear if base_kind == "linear" else QuantizedLinear.from_linear(linear, "nf4_per_group_64")
    model = nn.Sequential(LoRALinear(base, r=4, alpha=8.0))
    with torch.no_grad():
        model[0].lora_B["default"].weight.normal_(0, 0.1)
    model[0].base_layer.requires_grad_(False)
    return model


def run(model: nn.Module, x: torch.Tensor, fused: bool, monkeypatch) -> tuple:
    """(output, how many forward calls the C kernels took, grads of x, A and B, output_seen_finite) through the C
    kernels (lora_product) or LoRALinear's two pieces as PyTorch ops."""
    import minituner.lora as lora

    monkeypatch.setattr(lora, "fused_fits", lora_product.fused_fits if fused else (lambda *a: False))
    calls = []
    monkeypatch.setattr(K, "forward_", lambda *a, _f=K.forward_: calls.append(1) or _f(*a))
    model = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
    A, B = model[0].lora_A["default"].weight, model[0].lora_B["default"].weight
    return y, len(calls), x.grad, A.grad, B.grad, model[0].output_seen_finite(y)


@pytest.mark.parametrize("base_kind", ["linear", "nf4"])
def test_a_fp32_lora_layer_runs_them_and_matches_its_pytorch_ops(base_kind, monkeypatch):
    model, x = layer(base_kind), torch.randn(2, 5, 64)  # (B, T, in): LoRALinear flattens it to rows
    y, calls, *grads, seen = run(model, x, True, monkeypatch)
    y_ref, calls_ref, *grads_ref, seen_ref = run(model, x, False, monkeypatch)
    assert (calls, calls_ref) == (1, 0)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, grads_ref):
        assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert seen is True and seen_ref is False  # (the kernels looked at every value they wrote)


def test_the_output_seen_finite_spares_the_guards_a_pass():
    """The kernels looked at every value of the output as they wrote it: the finite-output guards need not."""
    model = layer("nf4")
    y = model(torch.randn(6, 64))
    assert model[0].output_seen_finite(y) is True  # (only the C kernels say so)
    with torch.no_grad():
        model[0].lora_B["default"].weight[0, 0] = float("inf")
    y = model(torch.randn(6, 64))
    assert model[0].output_seen_finite(y) is False


def test_not_taken_under_autocast(monkeypatch):
    """CPU autocast runs the base's product in bf16: the fp32 kernels would be handed a bf16 output."""
    model = layer("linear")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, calls, *_ = run(model, torch.randn(6, 64), True, monkeypatch)
    assert calls == 0 and y.dtype == torch.bfloat16

"""minituner.native_lora: the adapter's thin products in C (AVX512-BF16, and AMX's tiles where the CPU has them),
against fp32 references of the same bf16 operands, on ragged shapes and strided rows; the same bits on one thread
or two; NaN carried; every value the forward writes looked at for NaN and inf."""
import pytest
import torch

from minituner import native_lora

pytestmark = pytest.mark.skipif(native_lora.kernels() is None,
                                reason="minituner.native_lora needs AVX512-BF16 and a C compiler")
BF16 = torch.bfloat16
K = native_lora.kernels()
SHAPES = [  # N, K (in), M (out), r: full vectors, every tail (K % 32, M % 64 and % 16, odd N), r not a multiple of 8
    (1024, 512, 512, 8), (7, 45, 33, 2), (33, 100, 70, 10), (5, 32, 64, 16), (1, 31, 17, 18), (130, 2048, 96, 16)]


@pytest.fixture(autouse=True, params=["vdpbf16ps", "amx"])
def products_on(request):
    """Every test with x·Aᵀ and g·B on AVX-512's vdpbf16ps and, where the CPU has AMX (amx_bf16), on its tiles."""
    on = K.use_amx(request.param == "amx")
    if on != (request.param == "amx"):
        K.use_amx(True)
        pytest.skip("this CPU (or Linux) gives this process no AMX tiles")
    yield
    K.use_amx(True)  # the kernels' own choice


def close(got: torch.Tensor, ref: torch.Tensor, unit: float) -> bool:
    """Within `unit` of each value (relative), or of the largest for values near 0 (the sums' order differs)."""
    return torch.allclose(got.float(), ref, rtol=unit, atol=unit * ref.abs().max().item())


def operands(n, k, m, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k + 3, generator=g).to(BF16)[:, :k]  # rows with a stride of their own
    return (x, torch.randn(r, k, generator=g), torch.randn(m, r, generator=g),
            torch.randn(n, m, generator=g).to(BF16), torch.randn(n, m, generator=g).to(BF16))


@pytest.mark.parametrize("n, k, m, r", SHAPES)
def test_forward_backward_and_input_update_match_fp32(n, k, m, r):
    x, A, B, g, y0 = operands(n, k, m, r)
    Ab, Bb, xf, gf = A.to(BF16).float(), B.to(BF16).float(), x.float(), g.float()  # the masters as .to(bf16) rounds
    y = y0.clone()
    a, finite = K.forward_(y, x, A, B, 0.5)
    assert a.dtype == BF16 and a.shape == (n, r) and finite is True
    assert close(a, xf @ Ab.t(), 2**-8)
    assert close(y, y0.float() + 0.5 * a.float() @ Bb.t(), 2**-8)  # rounded once, from the rounded a
    grad_a, grad_A, grad_B = K.backward(g, x, a, B, 0.5)
    assert close(grad_a, 0.5 * gf @ Bb, 2**-8)
    assert grad_A.dtype == grad_B.dtype == torch.float32
    assert close(grad_A, grad_a.float().t() @ xf, 1e-5)  # fp32 sums of exact products of bf16 values
    assert close(grad_B, 0.5 * gf.t() @ a.float(), 1e-5)
    grad_x = x.contiguous()
    K.input_update_(grad_x, grad_a, A)
    assert close(grad_x, xf + grad_a.float() @ Ab, 2**-8)


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

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = everything()
        torch.set_num_threads(2)
        two = everything()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(one, two))


@pytest.mark.parametrize("n, k, m, r", SHAPES + [(9, 64, 1100, 4), (6, 1100, 2050, 2)])  # (y in chunks of 1,024)
def test_the_same_bits_in_fmas_as_in_vdpbf16ps(n, k, m, r):
    """The sums of y's update (forward_, input_update_) and of the masters' gradients (backward) in fp32 FMAs
    (use_fma: the default where the library is built for a CPU with AMX) or in vdpbf16ps: the same bits, with values
    whose products fall among fp32's denormals and below (the FMAs run under DAZ and FTZ, as vdpbf16ps treats
    denormals), NaN and inf among them."""
    gen = torch.Generator().manual_seed(n + k + m + r)

    def spread(*shape):  # magnitudes from 2^-140 (a denormal) to 2^8
        return torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-140, 9, shape, generator=gen).float()

    x, g, a, A, B = spread(n, k).to(BF16), spread(n, m).to(BF16), spread(n, r).to(BF16), spread(r, k), spread(m, r)
    y0, grad_x0 = spread(n, m).to(BF16), spread(n, k).to(BF16)
    x[0, 0], g[0, -1], a[-1, -1], A[0, 0] = 2.0 ** -130, -(2.0 ** -127), 2.0 ** -133, 2.0 ** -131  # denormals
    if n > 2:
        g[2, 0], a[1, 0], y0[2, -1] = float("inf"), float("nan"), float("nan")
    default = K.fma
    try:
        runs = []
        for on in (False, True):
            assert K.use_fma(on) is on
            y, grad_x = y0.clone(), grad_x0.clone()
            a_, finite = K.forward_(y, x, A, B, 0.5)
            K.input_update_(grad_x, a, A)
            runs.append((y, a_, grad_x, *K.backward(g, x, a, B, 0.5), torch.tensor(finite)))
    finally:
        K.use_fma(default)
    bits = {BF16: torch.int16, torch.float32: torch.int32, torch.bool: torch.bool}
    for p, q in zip(*runs):  # y, a, grad_x, grad_a, grad_A, grad_B, finite: bit for bit, NaN's too
        assert torch.equal(p.view(bits[p.dtype]), q.view(bits[q.dtype]))
    grad_B = runs[0][5]
    assert n <= 2 or (grad_B.isnan().any() and grad_B.isfinite().any())  # NaN in some sums, not in all


def test_nan_is_carried_as_pytorch_writes_it():
    x, A, B, g, y0 = operands(4, 64, 32, 2)
    x[1, 5] = float("nan")
    y = y0.clone()
    a, finite = K.forward_(y, x, A, B, 1.0)
    assert not finite
    assert a[1].isnan().all() and y[1].isnan().all() and not a[[0, 2, 3]].isnan().any()
    assert (y[1].view(torch.int16) == 0x7FC0).all()  # PyTorch's NaN


def test_fits_refuses_what_the_c_does_not_take():
    x, A, B = torch.randn(3, 64).to(BF16), torch.randn(4, 64), torch.randn(48, 4)
    assert native_lora.fits(x, A, B)
    assert not native_lora.fits(x, A[:, :32], B)  # A's width is not x's
    assert not native_lora.fits(x, A, B[:, :2])  # B's rank is not A's
    big = native_lora.MAX_RANK + 2
    assert not native_lora.fits(x, torch.randn(big, 64), torch.randn(48, big))
    assert not native_lora.fits(x, A.t().contiguous().t(), B)  # a master that is a transposed view


def test_the_masters_gradients_without_grad_a_are_refused_in_c():
    """grad_A is summed from grad_a: the C refuses to be asked for one without the other (no NULL read)."""
    x, A, B, g, _ = operands(8, 64, 32, 2)
    a, _ = K.forward_(g.clone(), x, A, B, 1.0)
    grad_A = torch.empty(2, 64)
    rc = K._backward(g.data_ptr(), g.stride(0), x.data_ptr(), x.stride(0), a.data_ptr(), B.data_ptr(), 8, 64, 32, 2,
                     1.0, None, grad_A.data_ptr(), None, 1, 1)
    assert rc == 2
    with pytest.raises(ValueError, match="grad_a"):
        K._check(rc)


def test_no_rows_give_zero_gradients():
    x, A, B, g, _ = operands(0, 64, 32, 2)
    _, grad_A, grad_B = K.backward(g, x, torch.empty(0, 2, dtype=BF16), B, 1.0)
    assert grad_A.shape == (2, 64) and not grad_A.any() and grad_B.shape == (32, 2) and not grad_B.any()


@pytest.mark.parametrize("n, k, m, r", [(33, 100, 70, 10), (5, 32, 64, 16), (130, 64, 17, 2),
                                        (2048, 128, 136, 8)])  # (the last large enough for two threads)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_forward_reports_any_non_finite_value_it_writes(n, k, m, r, bad):
    """Whichever row and column (the 64-wide blocks, the 16-wide rest and its last ragged columns), on one thread
    or two."""
    x, A, B, _, y0 = operands(n, k, m, r)
    if n * (k + m) >= 2 * native_lora.MIN_VALUES_PER_THREAD:
        assert K._threads(n * (k + m))[1] == min(2, torch.get_num_threads(), native_lora.CPU_COUNT) or not K._split.openmp
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for row, col in [(0, 0), (n - 1, m - 1), (n // 2, m // 2), (n - 1, 63 % m), (0, (m - 1) // 16 * 16)]:
                y = y0.clone()
                y[row, col] = bad
                assert K.forward_(y, x, A, B, 0.5)[1] is False, (t, row, col)
                assert K.forward_(y0.clone(), x, A, B, 0.5)[1] is True
    finally:
        torch.set_num_threads(threads)


def test_a_sum_beyond_bf16s_range_is_reported():
    """Finite fp32 sums that round to inf in bf16 count as what is written: inf."""
    x, A, B = torch.ones(4, 64, dtype=BF16), torch.full((2, 64), 0.01), torch.zeros(32, 2)
    B[3] = 7.8e35  # a[n, j] = 0.64: y[:, 3] gets about 1.0e36 more
    y = torch.zeros(4, 32, dtype=BF16)
    y[2, 3] = torch.finfo(BF16).max  # 3.3895e38: + 1.0e36 is a finite fp32 sum past the midpoint to bf16's inf
    a, finite = K.forward_(y, x, A, B, 1.0)
    assert not finite and y[2, 3] == float("inf") and torch.isfinite(y[[0, 1, 3]]).all()
    y[2, 3] = 3.0e38
    assert K.forward_(y, x, A, B, 1.0)[1] is True and torch.isfinite(y).all()

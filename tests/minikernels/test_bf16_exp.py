"""minikernels.bf16_exp: exp16 (16 lanes) and exp_nonpos (plain C) give the same bits for every input, and both
are within about one unit in the last place of fp32 of the exact exp (float64); store16, round16 and store16_bits
round fp32 to bf16 as PyTorch does, whichever of store16's two paths a group of 16 takes."""
import ctypes

import pytest
import torch

from minikernels.bf16_exp import BF16_EXP_C
from minikernels.build import build_library, find_compiler

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]

HARNESS = r"""
int has_exp16(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* n (a multiple of 16) inputs: exp16's results into vec, exp_nonpos's into scalar */
void exp_both(const float* x, float* vec, float* scalar, int64_t n) {
#ifdef __AVX512F__
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(vec + i, exp16(_mm512_loadu_ps(x + i)));
#endif
    for (int64_t i = 0; i < n; i++) scalar[i] = exp_nonpos(x[i]);
}

/* n (a multiple of 16) fp32 values rounded to bf16 by store16 (fast), store16_bits (bits) and round16 (rounded, the
   fp32 value kept) */
void round_all(const float* x, uint16_t* fast, uint16_t* bits, float* rounded, int64_t n) {
#ifdef __AVX512F__
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        store16(fast + i, v);
        store16_bits(bits + i, v);
        _mm512_storeu_ps(rounded + i, round16(v));
    }
#endif
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    mp = pytest.MonkeyPatch()
    mp.setenv("MINIQUANT_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        lib = ctypes.CDLL(str(build_library("bf16_exp_test", BF16_EXP_C + HARNESS, CFLAGS, compiler, ["-lm"])))
    finally:
        mp.undo()
    lib.exp_both.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.exp_both.restype = None
    lib.round_all.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    lib.round_all.restype = None
    if not lib.has_exp16():
        pytest.skip("built without AVX-512: no exp16")
    return lib


def _inputs() -> torch.Tensor:
    """Every bf16 value in [-90, 0] as fp32, 200,000 uniform fp32 values in [-88, 0], and the edges: the cut-off
    at -87.33654 and its neighbours, -0.0, the smallest magnitudes; padded to a multiple of 16."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = bits[(bits <= 0) & (bits >= -90)]
    uniform = -88 * torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    cut = torch.tensor(-87.33654)
    edges = torch.stack([cut, torch.nextafter(cut, torch.tensor(0.0)), torch.nextafter(cut, torch.tensor(-100.0)),
                         torch.tensor(-0.0), torch.tensor(0.0), torch.tensor(-1e-30), torch.tensor(-1e-45)])
    x = torch.cat([every, uniform, edges])
    return torch.cat([x, torch.zeros(-x.numel() % 16)]).contiguous()


@pytest.fixture(scope="module")
def results(lib):
    """(inputs, exp16's results, exp_nonpos's results)."""
    x = _inputs()
    vec, scalar = torch.empty_like(x), torch.empty_like(x)
    lib.exp_both(x.data_ptr(), vec.data_ptr(), scalar.data_ptr(), x.numel())
    return x, vec, scalar


def test_the_16_lane_and_the_scalar_exp_give_the_same_bits(results):
    _, vec, scalar = results
    assert torch.equal(vec.view(torch.int32), scalar.view(torch.int32))


def test_exp_is_within_about_an_ulp_of_the_exact_value_and_0_below_the_cut(results):
    x, vec, _ = results
    exact = torch.exp(x.double())
    normal = x >= -87.33654  # above the cut the result is a normal fp32 value
    rel = ((vec.double() - exact).abs() / exact)[normal]
    assert rel.max().item() < 2 ** -23  # fp32's unit in the last place, relative, at its largest (8.1e-8 here)
    assert torch.all(vec[~normal] == 0)
    assert vec[x == 0].eq(1).all()


def test_store16_and_round16_round_as_pytorch_on_either_path(lib):
    """Groups of 16 finite normal values (store16's one-instruction path where the CPU has AVX512-BF16) and groups
    holding a NaN or a denormal (its integer path) give PyTorch's bf16 bits (NaN as 0x7FC0), as store16_bits
    does; round16 gives the same values in fp32. Ties, the largest finite values, inf, zeros and fp32 denormals
    included."""
    g = torch.Generator().manual_seed(0)
    finite = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-40, 40, (4096,), generator=g).float())
    ties = (torch.randint(0, 1 << 15, (512,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    edges = torch.tensor([3.4028235e38, -3.4028235e38, 3.39e38, float("inf"), -float("inf"), 0.0, -0.0,
                          1.1754944e-38, 1e-40, -1e-40, 1e-45, float("nan"), 1.0, -1.0, 2.0, 0.5])
    clean = torch.cat([finite, ties[ties.isfinite()]])
    clean = clean[: clean.numel() // 16 * 16]  # whole groups of normal values: the fast path where there is one
    x = torch.cat([clean, edges]).contiguous()
    x = torch.cat([x, torch.zeros(-x.numel() % 16)])
    fast, bits = (torch.empty(x.numel(), dtype=torch.int16) for _ in range(2))
    rounded = torch.empty_like(x)
    lib.round_all(x.data_ptr(), fast.data_ptr(), bits.data_ptr(), rounded.data_ptr(), x.numel())
    ref = x.to(torch.bfloat16).view(torch.int16).clone()
    nan = x.isnan()
    ref[nan] = 0x7FC0  # PyTorch's scalar rule (its vectorized conversion writes 0xFFFF: both NaN)
    assert torch.equal(fast, ref) and torch.equal(bits, ref)
    assert torch.equal(rounded[~nan], x.to(torch.bfloat16).float()[~nan]) and rounded[nan].isnan().all()

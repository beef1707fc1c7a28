"""The native NF4 kernels (miniquant/native.py) give the same bytes as the eager path and bitsandbytes.

The native path normally starts at NF4 tensors of `NATIVE_MIN_ELEMENTS` values; here the threshold is
lowered so that small tensors take it too, and each result is compared with the eager path's.
"""
import ctypes
import os
import signal
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miniquant import dequantize_nf4, nf4, quantize_nf4
from miniquant import native
from miniquant.nf4 import NF4Tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

if native.kernels() is None:
    pytest.skip("no C compiler, or MINIQUANT_NATIVE=0: the native NF4 kernels are not built", allow_module_level=True)


def both_paths(monkeypatch, fn):
    """(native result, eager result) of fn(); the native call splits even a few blocks across threads."""
    monkeypatch.setattr(nf4, "NATIVE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(native, "MIN_VALUES_PER_THREAD", 1)
    monkeypatch.setattr(native, "MIN_VALUES_PER_THREAD_WARM", 1)
    monkeypatch.setattr(native, "CHUNK_VALUES", 64)
    fast = fn()
    monkeypatch.setattr(nf4, "NATIVE_MIN_ELEMENTS", 1 << 62)
    slow = fn()
    return fast, slow


def assert_same(monkeypatch, w: torch.Tensor, blocksize: int = 64) -> None:
    fast, slow = both_paths(monkeypatch, lambda: quantize_nf4(w, blocksize=blocksize))
    assert torch.equal(fast.packed, slow.packed), "packed bytes differ between native and eager paths"
    assert torch.equal(fast.absmax, slow.absmax), "absmax differs between native and eager paths"
    for dtype in DTYPES:
        d_fast, d_slow = both_paths(monkeypatch, lambda: dequantize_nf4(slow, dtype))
        assert d_fast.dtype == dtype and d_fast.shape == w.shape
        assert torch.equal(d_fast, d_slow), f"dequantized {dtype} differs between native and eager paths"
        buffer = torch.full((w.numel(),), float("nan"), dtype=dtype)  # an existing buffer: written by several threads
        d_into, _ = both_paths(monkeypatch, lambda: dequantize_nf4(slow, dtype, out=buffer).clone())  # before the
        # eager path writes the same buffer
        assert torch.equal(d_into, d_slow), f"dequantized {dtype} into a buffer differs from the eager path"
        buffer.fill_(float("nan"))
        d_streamed, _ = both_paths(monkeypatch, lambda: dequantize_nf4(slow, dtype, out=buffer, stream=True).clone())
        assert torch.equal(d_streamed, d_slow), f"dequantized {dtype} with stream=True differs from the eager path"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(256, 96), (64, 64), (130,), (33, 17), (5, 130), (3, 64, 2)], ids=str)
def test_native_equals_eager(monkeypatch, shape, dtype):
    torch.manual_seed(hash(shape) % 1000)
    assert_same(monkeypatch, (torch.randn(shape) * 0.05).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("offset", [0, 1, 16], ids=lambda o: f"offset{o}")
def test_streamed_stores_give_the_same_values(monkeypatch, blocksize, offset, dtype):
    """stream=True (non-temporal stores, taken only into a 64-byte aligned out, for bf16 and fp16 with blocks of a
    multiple of 32 values) gives the bits of normal stores: into an out offset by `offset` values from an aligned
    start (1: not aligned, the normal stores; 16: aligned for float32 only), for every block size's path (16 and
    48: the vector loop's 8-byte tail)."""
    torch.manual_seed(blocksize + offset)
    q = quantize_nf4(torch.randn(64, 96 * blocksize // 16) * 0.05, blocksize=blocksize)
    backing = torch.full((q.numel + 64,), float("nan"), dtype=dtype)
    assert backing.data_ptr() % 64 == 0  # (PyTorch's CPU allocations are 64-byte aligned)
    out = backing[offset: offset + q.numel]
    streamed, normal = both_paths(monkeypatch, lambda: dequantize_nf4(q, dtype, out=out, stream=True).clone())
    assert torch.equal(streamed, normal)
    assert torch.equal(streamed, dequantize_nf4(q, dtype, out=out.clone(), stream=False))
    assert backing[:offset].isnan().all() and backing[offset + q.numel:].isnan().all()  # nothing written outside


@pytest.mark.parametrize("blocksize", [32, 128, 256, 4096])
def test_other_block_sizes(monkeypatch, blocksize):
    torch.manual_seed(blocksize)
    assert_same(monkeypatch, torch.randn(3 * blocksize + 10), blocksize)


def test_edge_values(monkeypatch):
    """Zero blocks, values on the midpoints, tiny and huge magnitudes, negative zero."""
    mids = nf4.nf4_midpoints()
    w = torch.cat([
        torch.zeros(64),
        torch.cat([mids, torch.ones(1), -mids.flip(0), -torch.ones(1)]).repeat(2),  # exactly on midpoints
        torch.full((64,), -0.0),
        torch.randn(64) * 1e-39,  # subnormal values
        torch.randn(64) * 3e38,
        torch.tensor([1e-38, -1e-38] * 32),
    ])
    for dtype in DTYPES:
        v = w.to(dtype)
        if torch.isfinite(v).all():
            assert_same(monkeypatch, v)


@given(
    rows=st.integers(1, 40),
    cols=st.sampled_from([64, 96, 128, 130, 200]),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=40, deadline=None)
def test_native_equals_eager_hypothesis(rows, cols, dtype, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 2.0**log_scale).to(dtype)
    if not torch.isfinite(w).all():
        return
    with pytest.MonkeyPatch.context() as mp:
        assert_same(mp, w)


# The source has a path per instruction set; -march=native builds only the widest this CPU has. Turning the
# wider sets off builds the others, so every path this CPU can run is checked against the eager bytes.
# (AVX-512 with its BW subset looks a 16-bit result up from 16 rounded values; without BW each value is rounded.)
INSTRUCTION_SETS = {"widest": [], "avx512 without bw": ["-mno-avx512bw"], "avx2": ["-mno-avx512f"],
                    "plain C": ["-mno-avx2", "-mno-avx512f"]}


@pytest.mark.parametrize("extra_flags", INSTRUCTION_SETS.values(), ids=INSTRUCTION_SETS.keys())
def test_every_instruction_set_path_gives_the_eager_bytes(monkeypatch, extra_flags):
    from minikernels.build import build_library, find_compiler

    compiler = find_compiler()
    try:
        lib = ctypes.CDLL(str(build_library("nf4_test", native._SOURCE, native.CFLAGS + extra_flags, compiler)))
    except RuntimeError as e:  # a compiler that does not know the flag
        pytest.skip(f"cannot build with {extra_flags}: {e}")
    variant = native.NativeKernels(lib)
    monkeypatch.setattr(native, "kernels", lambda: variant)
    torch.manual_seed(11)
    mids = nf4.nf4_midpoints()
    on_midpoints = torch.cat([mids, torch.ones(1), -mids.flip(0), -torch.ones(1)]).repeat(2)
    for blocksize in (64, 32, 16, 48, 128, 4096):
        w = torch.cat([torch.randn(5 * blocksize + 6) * 0.02, on_midpoints, torch.zeros(blocksize), torch.full((blocksize,), -0.0)])
        for dtype in variant.dtypes:
            assert_same(monkeypatch, w.to(dtype), blocksize)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_path_rejects_nan_inf(monkeypatch, bad, dtype):
    monkeypatch.setattr(nf4, "NATIVE_MIN_ELEMENTS", 1)
    w = torch.randn(40, 64).to(dtype)
    w[17, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nf4(w)


def test_large_tensor_uses_native_path_and_matches_bitsandbytes():
    """A tensor above the threshold, several threads' worth of blocks, against bitsandbytes itself."""
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    w = torch.randn(512, 1024)
    assert w.numel() >= nf4.NATIVE_MIN_ELEMENTS
    q = quantize_nf4(w)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(q.packed, packed.reshape(-1)) and torch.equal(q.absmax, state.absmax)
    hi, lo = (q.packed >> 4).long(), (q.packed & 0xF).long()
    codes = torch.stack([hi, lo], dim=1).reshape(-1)
    expected = (nf4.nf4_code_table()[codes] * q.absmax.repeat_interleave(64)).reshape(w.shape)
    assert torch.equal(dequantize_nf4(q), expected)


def test_double_quant_scales_through_native_dequantize(monkeypatch):
    torch.manual_seed(3)
    q = quantize_nf4(torch.randn(300, 64), double_quant=True)
    fast, slow = both_paths(monkeypatch, lambda: dequantize_nf4(q, torch.float32))
    assert torch.equal(fast, slow)
    rebuilt = NF4Tensor(q.packed, q.block_scales(), q.shape, q.dtype, q.blocksize)
    assert torch.equal(fast, dequantize_nf4(rebuilt, torch.float32))


@pytest.mark.parametrize("env", [{"CC": "/nonexistent/cc"}, {"MINIQUANT_NATIVE": "0"}], ids=["no-compiler", "disabled"])
def test_without_native_kernels_the_eager_path_gives_the_same_bytes(tmp_path, env):
    code = (
        "import torch, warnings; from miniquant import native, quantize_nf4, dequantize_nf4\n"
        "warnings.simplefilter('ignore')\n"
        "w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))\n"
        "q = quantize_nf4(w); d = dequantize_nf4(q)\n"
        "print(native.kernels() is None, q.packed.sum().item(), d.sum().item())\n"
    )
    def run(extra):
        base = {k: v for k, v in os.environ.items() if k not in ("CC", "MINIQUANT_NATIVE")}
        full_env = {**base, "MINIQUANT_CACHE": str(tmp_path / "cache"), **extra}
        out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    without, with_native = run(env), run({})
    assert without[0] == "True" and with_native[0] == "False"
    assert without[1:] == with_native[1:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_quantizes_with_threads(monkeypatch):
    """A child forked after the thread pool started gets a fresh pool instead of waiting on the parent's threads."""
    monkeypatch.setattr(native, "MIN_VALUES_PER_THREAD", 1)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(5))
    expected = quantize_nf4(w).packed  # starts the pool in the parent
    pid = os.fork()
    if pid == 0:  # child: exit code says whether the bytes matched; SIGALRM ends it rather than hang
        signal.alarm(120)
        os._exit(0 if torch.equal(quantize_nf4(w).packed, expected) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_scales_within_agrees_with_a_look_at_every_value():
    """quantize._nf4_surely_finite's C check: |s| <= limit for all, NaN and ±inf failing, at any position."""
    k = native.kernels()
    if k is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 4096, 16385):
        s = torch.randn(n, generator=g) * 100
        assert k.scales_within(s, 1e4) is bool((s.abs() <= 1e4).all())
        for bad in (float("nan"), float("inf"), -float("inf"), 2e4, -2e4):
            for i in {0, n // 2, n - 1}:
                t = s.clone()
                t[i] = bad
                assert k.scales_within(t, 1e4) is False, (n, bad, i)
    edge = torch.tensor([65504.0, -65504.0])  # fp16's largest value: within, exactly
    assert k.scales_within(edge, torch.finfo(torch.float16).max) is True
    assert k.scales_within(edge * 1.001, torch.finfo(torch.float16).max) is False
    with pytest.raises(ValueError, match="contiguous float32"):
        k.scales_within(torch.ones(4, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="finite float32"):
        k.scales_within(edge, torch.finfo(torch.float64).max)  # inf as a C float: every finite scale within
    from miniquant.quantize import _nf4_surely_finite
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert _nf4_surely_finite(torch.ones(64), dtype)
        assert not _nf4_surely_finite(torch.tensor([1.0, float("inf")]), dtype)

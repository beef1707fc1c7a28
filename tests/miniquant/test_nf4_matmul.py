"""miniquant.nf4_matmul: an NF4 weight's input gradient g·W with bf16 g, the codes unpacked inside the product
(AVX512-BF16), against fp64 references of the same bf16 operands on ragged shapes (row tails, column units short of
NB, K over the KC chunk); a LoRA adapter's share added inside the same sums and rounded once; the same bits on one
thread or many; NaN carried; where it is used (QuantizedLinear and minituner.lora_product, bf16 on CPU) and where
not; and how minituner.planner counts its buffers."""
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch

from miniquant import nf4_matmul

pytestmark = pytest.mark.skipif(nf4_matmul.kernels() is None,
                                reason="miniquant.nf4_matmul needs AVX512-BF16 and a C compiler")
BF16 = torch.bfloat16
K = nf4_matmul.kernels()


@pytest.fixture(autouse=True)
def no_amx(monkeypatch):
    """Layers choose the kernel on CPUs without AMX (``nf4_matmul.chosen``): these tests run it on every CPU that
    builds it, AMX or not, as if it had none; test_with_amx_the_workspace_path_is_chosen mocks the other way."""
    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: False)
# rows N, in, out, blocksize: full microkernel rows and units, a row tail (N % 14), fewer rows than one
# microkernel, a column unit short of NB (in % 128), K = out over KC (576 = 512 + 64; 1088), blocks of 32 and 128
SHAPES = [(1024, 512, 512, 64), (13, 64, 32, 64), (100, 160, 576, 32), (37, 1088, 96, 32), (29, 128, 1088, 128),
          (1, 256, 64, 64)]


@pytest.mark.parametrize("n, n_in, n_out, bs", SHAPES)
def test_input_grad_matches_fp64_of_the_same_bf16_operands(n, n_in, n_out, bs, nf4_linear, bf16_close, nf4_parts):
    layer = nf4_linear(n_in, n_out, bs)
    w = layer.dequantize(BF16).double()  # the values the workspace path multiplies
    dy = torch.randn(n, n_out, generator=torch.Generator().manual_seed(1)).to(BF16)
    gx = K.input_grad(dy, *nf4_parts(layer), n_in)
    assert gx.dtype == BF16 and gx.shape == (n, n_in)
    assert bf16_close(gx, dy.double() @ w)


def test_the_same_bits_on_one_thread_or_many(nf4_linear, nf4_parts):
    """Each output value is summed by one thread in k order, whatever the split into column units and row groups."""
    layer = nf4_linear(288, 1088, 64)
    dy = torch.randn(300, 1088, generator=torch.Generator().manual_seed(2)).to(BF16)
    results = []
    for split in ((1, 1), (2, 1), (2, 3), (3, 7)):
        with mock.patch.object(nf4_matmul.NF4Matmul, "_threads", lambda self, m, k, n, s=split: s):
            results.append(K.input_grad(dy, *nf4_parts(layer), 288))
    for gx in results[1:]:
        assert torch.equal(gx, results[0])



@pytest.mark.parametrize("n, n_in, n_out", [(37, 128, 2048), (100, 160, 6144), (15, 96, 4096)])
def test_rows_a_multiple_of_4_kib_apart_give_the_bits_of_rows_read_in_place(n, n_in, n_out, nf4_linear, bf16_close,
                                                                            nf4_parts):
    """g's rows a multiple of 4 KiB apart (out 2,048, 4,096, 6,144 bf16) share one of L1's sets, so the kernel
    copies each 14 rows of a K chunk apart before multiplying; rows a stride apart that is no such multiple are read
    in place. Both give the same bits (row tails, K over KC, one thread and several), with an adapter's share and
    GELU's gradient too, and match the fp64 product."""
    gen = torch.Generator().manual_seed(5)
    layer = nf4_linear(n_in, n_out, 64)
    parts = nf4_parts(layer)
    dy = torch.randn(n, n_out, generator=gen).to(BF16)
    apart = torch.zeros(n, n_out + 32, dtype=BF16)[:, :n_out]  # rows 2 (n_out + 32) bytes apart
    apart.copy_(dy)
    adapter = (torch.randn(n, 4, generator=gen).to(BF16), torch.randn(4, n_in, generator=gen) * 0.3)
    gelu = (torch.randn(n, n_in, generator=gen).to(BF16), "none")
    for split in ((1, 1), (2, 1), (2, 3)):
        with mock.patch.object(nf4_matmul.NF4Matmul, "_threads", lambda self, m, k, n, s=split: s):
            for extra in ((), (adapter,), (adapter, gelu)):
                got = K.input_grad(dy, *parts, n_in, *extra)
                assert torch.equal(got, K.input_grad(apart, *parts, n_in, *extra)), (split, len(extra))
    assert bf16_close(K.input_grad(dy, *parts, n_in), dy.double() @ layer.dequantize(BF16).double())

def test_nan_is_carried_to_its_row_and_rows_with_a_stride_are_read_as_such(nf4_linear, bf16_close, nf4_parts):
    layer = nf4_linear(128, 64, 64)
    dy = torch.randn(20, 96).to(BF16)[:, :64]  # rows 96 apart
    dy[3, 5] = float("nan")
    gx = K.input_grad(dy, *nf4_parts(layer), 128)
    assert torch.isnan(gx[3]).all() and not torch.isnan(gx[torch.arange(20) != 3]).any()
    assert gx.view(torch.int16)[3, 0].item() == 0x7FC0  # as PyTorch rounds a NaN to bf16
    assert bf16_close(gx[:3], dy[:3].double() @ layer.dequantize(BF16).double())


def test_no_rows(nf4_linear, nf4_parts):
    layer = nf4_linear(64, 32, 64)
    assert K.input_grad(torch.empty(0, 32, dtype=BF16), *nf4_parts(layer), 64).shape == (0, 64)


def test_what_fits():
    g = torch.randn(4, 64).to(BF16)
    assert nf4_matmul.fits(g, 128, 64, 64)
    assert not nf4_matmul.fits(g.float(), 128, 64, 64)  # fp32: the workspace path
    assert not nf4_matmul.fits(torch.randn(64, 4).to(BF16).t(), 128, 64, 64)  # columns with a stride
    assert not nf4_matmul.shape_fits(128, 64, 48)  # blocks not a multiple of 32 values
    assert not nf4_matmul.shape_fits(96, 64, 64)  # blocks that straddle rows
    assert not nf4_matmul.shape_fits(128, 48, 64)  # out not a multiple of NR
    assert nf4_matmul.shape_fits(4096, 11008, 64) and nf4_matmul.shape_fits(896, 128, 64)  # Llama-2-7B MLP, Qwen2 k


@contextmanager
def counting_calls():
    """The kernel's calls, by name, while in the block."""
    calls = []
    with ExitStack() as stack:
        for name in ("input_grad",):
            real = getattr(nf4_matmul.NF4Matmul, name)

            def counted(self, *args, real=real, name=name):
                calls.append(name + ("+adapter" if len(args) > 5 and args[5] is not None else ""))
                return real(self, *args)
            stack.enter_context(mock.patch.object(nf4_matmul.NF4Matmul, name, counted))
        yield calls


def test_quantized_linear_in_bf16_takes_it_backward_and_matches_the_workspace_path(nf4_linear, bf16_close):
    layer = nf4_linear(256, 96, 64)
    layer.compute_dtype = BF16
    x = torch.randn(2, 10, 256).to(BF16).requires_grad_()
    with counting_calls() as calls:
        y = layer(x)
        y.float().square().sum().backward()
    assert calls == ["input_grad"]
    gx = x.grad
    x.grad = None
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False):
        y_ws = layer(x)
        y_ws.float().square().sum().backward()
    assert bf16_close(y, y_ws.double()) and bf16_close(gx, x.grad.double())
    layer.compute_dtype = None
    with counting_calls() as calls:  # fp32 compute: the workspace path
        layer(x.detach().float().requires_grad_()).square().sum().backward()
    assert calls == []


def test_lora_product_takes_it_and_gives_the_workspace_paths_gradients(nf4_lora_run, bf16_close):
    from minituner import native_lora

    run = lambda: nf4_lora_run()[0]  # noqa: E731  (the values; seen finite is test_nf4_amx's)
    updates = []
    real_update = native_lora.NativeLoRA.input_update_

    def update(self, *args):
        updates.append(1)
        return real_update(self, *args)

    with counting_calls() as calls, mock.patch.object(native_lora.NativeLoRA, "input_update_", update):
        fused = run()
        assert calls == ["input_grad+adapter"] and updates == []  # the adapter's share inside the product
        with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False):
            workspace = run()
        assert calls == ["input_grad+adapter"] and len(updates) == 1  # the workspace's, then native_lora's
    for a, b in zip(fused, workspace):
        assert bf16_close(a, b.double())


def ulp_bound(ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit in the last place of each reference value (one rounding), plus fp32 summation error
    (2^-20 of the sum of the terms' magnitudes)."""
    exponent = torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -120)))
    return 2.0 ** (exponent - 8) + 2.0 ** -20 * scale


ADAPTER_SHAPES = [(1024, 512, 512, 8), (37, 1088, 96, 2), (100, 160, 576, 16), (13, 64, 32, 64), (29, 128, 1088, 6)]


@pytest.mark.parametrize("n, n_in, n_out, r", ADAPTER_SHAPES)
def test_an_adapters_share_is_summed_with_w_and_rounded_once(n, n_in, n_out, r, nf4_linear, nf4_parts):
    """g·W + grad_a·A in one set of fp32 sums, rounded once: within half a bf16 ulp of the fp64 sum of the same
    bf16 operands (A's fp32 master rounded as .to(bfloat16) rounds it); two roundings would be up to a whole ulp."""
    gen = torch.Generator().manual_seed(3)
    layer = nf4_linear(n_in, n_out, 32)
    w = layer.dequantize(BF16).double()
    dy = torch.randn(n, n_out, generator=gen).to(BF16)
    grad_a = torch.randn(n, r, generator=gen).to(BF16)
    A = torch.randn(r, n_in, generator=gen) * 0.3
    got = K.input_grad(dy, *nf4_parts(layer), n_in, (grad_a, A))
    ref = dy.double() @ w + grad_a.double() @ A.to(BF16).double()
    scale = dy.double().abs() @ w.abs() + grad_a.double().abs() @ A.to(BF16).double().abs()
    assert ((got.double() - ref).abs() <= ulp_bound(ref, scale)).all()


def test_with_an_adapter_the_same_bits_on_one_thread_or_many(nf4_linear, nf4_parts):
    layer = nf4_linear(288, 1088, 64)
    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(300, 1088, generator=gen).to(BF16)
    adapter = (torch.randn(300, 8, generator=gen).to(BF16), torch.randn(8, 288, generator=gen))
    results = []
    for split in ((1, 1), (2, 1), (2, 3), (3, 7)):
        with mock.patch.object(nf4_matmul.NF4Matmul, "_threads", lambda self, m, k, n, s=split: s):
            results.append(K.input_grad(dy, *nf4_parts(layer), 288, adapter))
    for gx in results[1:]:
        assert torch.equal(gx, results[0])


def test_what_adapter_fits():
    g, grad_a, A = torch.randn(4, 64).to(BF16), torch.randn(4, 8).to(BF16), torch.randn(8, 128)
    assert nf4_matmul.adapter_fits(g, grad_a, A, 128)
    assert not nf4_matmul.adapter_fits(g, grad_a[:, :7], A[:7], 128)  # an odd rank: the kernel pairs r
    assert not nf4_matmul.adapter_fits(g, grad_a, A.to(BF16), 128)  # A not an fp32 master
    assert not nf4_matmul.adapter_fits(g, grad_a.float(), A, 128)
    assert not nf4_matmul.adapter_fits(g, torch.randn(8, 4).to(BF16).t(), A, 128)  # grad_a not contiguous
    assert not nf4_matmul.adapter_fits(g, grad_a[:3], A, 128)  # not g's rows
    assert not nf4_matmul.adapter_fits(g, grad_a, A, 64)  # not the weight's in_features
    big = torch.randn(1, nf4_matmul.MAX_RANK + 2)
    assert not nf4_matmul.adapter_fits(g[:1], big.to(BF16), torch.randn(nf4_matmul.MAX_RANK + 2, 128), 128)


def test_with_amx_the_workspace_path_is_chosen(monkeypatch, nf4_linear, bf16_close):
    """On a CPU with AMX the layers dequantize into the workspace and oneDNN's GEMM (on AMX tiles) takes the
    product; nothing of this kernel runs, GELU is applied apart and the planner counts no panels. (Weights that
    miniquant.nf4_amx takes run on its own GEMM there: tests/miniquant/test_nf4_amx.py; off here.)"""
    from miniquant import nf4_amx

    assert nf4_matmul.chosen()
    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(nf4_amx, "usable", lambda: False)
    assert not nf4_matmul.chosen() and not nf4_matmul.takes_bf16_run()
    layer = nf4_linear(256, 96, 64)
    layer.compute_dtype = BF16
    assert not layer.applies_gelu_grad(BF16)
    x = torch.randn(2, 10, 256).to(BF16).requires_grad_()
    frozen = tuple(layer.quantized_tensors())
    dy = torch.randn(20, 96).to(BF16)
    with counting_calls() as calls:
        layer(x).float().square().sum().backward()
        assert layer.input_grad_adding(frozen, dy, torch.randn(20, 8).to(BF16), torch.randn(8, 256)) is None
    assert calls == [] and bf16_close(layer.input_grad_from(frozen, dy), dy.double() @ layer.dequantize(BF16).double())


def test_amx_is_read_from_the_cpus_flags(monkeypatch, tmp_path):
    monkeypatch.undo()  # this test reads the real check
    amx, no_amx = tmp_path / "amx", tmp_path / "no_amx"
    amx.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    no_amx.write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    monkeypatch.setattr(nf4_matmul, "CPUINFO", amx)
    assert nf4_matmul.cpu_has_amx()
    monkeypatch.setattr(nf4_matmul, "CPUINFO", no_amx)
    assert not nf4_matmul.cpu_has_amx()


def test_quantized_linear_adds_an_adapter_inside_where_it_fits_and_says_none_elsewhere(nf4_linear, bf16_close):
    layer = nf4_linear(256, 96, 64)
    frozen = tuple(layer.quantized_tensors())
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(40, 96, generator=gen).to(BF16)
    ref_w = dy.double() @ layer.dequantize(BF16).double()
    grad_a, A = torch.randn(40, 8, generator=gen).to(BF16), torch.randn(8, 256, generator=gen)
    with counting_calls() as calls:
        got = layer.input_grad_adding(frozen, dy, grad_a, A)
    assert calls == ["input_grad+adapter"] and bf16_close(got, ref_w + grad_a.double() @ A.to(BF16).double())
    assert layer.input_grad_adding(frozen, dy, grad_a[:, :7], A[:7]) is None  # an odd rank: the caller adds it
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False):  # no kernel for g: the caller's way too
        assert layer.input_grad_adding(frozen, dy, grad_a, A) is None
    assert layer.input_grad_adding(frozen, dy.float(), grad_a, A) is None  # fp32 g


def test_the_planner_counts_panels_where_it_runs_and_the_workspace_where_not():
    from minigpt.model import GPTConfig
    from minituner.planner import MemoryConfig, Regime, minigpt_shape, regime_bytes
    from minituner.planner.peak import step_peak

    shape = minigpt_shape(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=64))
    cfg = MemoryConfig(batch_size=2, seq_len=16, full_precision="fp32", activations="exact", dtype="fp32")
    b = regime_bytes(shape, Regime("qlora", 4), "all-linear", cfg)

    def terms(**kw):
        peak = step_peak(shape, "qlora", 4, "all-linear", 2, 16, 2, weights=b.weights, grads=b.grads,
                         optimizer=b.optimizer, stream_bytes=4, **kw)
        return peak.phases["optimizer step"]

    here = terms()  # the workspace for the forward (the largest weight, bf16), and the backward's panels
    assert here["NF4 dequantization workspace"] == 64 * 256 * 2
    from minituner import native_lora
    adapter = 4 if native_lora.takes_bf16_run() else 0  # the rank-4 adapter's panel, added inside the product
    assert here["NF4 input-gradient panels (nf4_matmul, per thread)"] == nf4_matmul.scratch_bytes(
        32, 256, nf4_matmul.team_threads(), adapter)  # K = out_features, at most fc1's 256
    assert nf4_matmul.scratch_bytes(32, 256, 2) == 2 * 128 * 256 * 2  # K within KC: the panel alone
    assert nf4_matmul.scratch_bytes(32, 256, 2, rank=8) == 2 * (128 * 256 * 2 + 4 * 128 * 4)  # and A's pairs
    with mock.patch.object(native_lora, "takes_bf16_run", lambda: False):  # no native adapter: no adapter panel
        assert terms()["NF4 input-gradient panels (nf4_matmul, per thread)"] == nf4_matmul.scratch_bytes(
            32, 256, nf4_matmul.team_threads())
    assert nf4_matmul.scratch_bytes(32, 1024, 1) == 128 * 512 * 2 + (32 + 14) * 128 * 4  # and the fp32 sums
    assert nf4_matmul.scratch_bytes(32, 1024, 1, copies_rows=True) == \
        128 * 512 * 2 + (32 + 14) * 128 * 4 + 14 * 544 * 2  # and its copy of 14 rows of g
    assert [nf4_matmul.rows_copied(k) for k in (256, 1024, 1088, 2048, 3072, 6144)] == [False] * 3 + [True, False, True]
    wide = minigpt_shape(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=512))  # fc1: out 2,048
    wb = regime_bytes(wide, Regime("qlora", 4), "all-linear", cfg)
    wide_peak = step_peak(wide, "qlora", 4, "all-linear", 2, 16, 2, weights=wb.weights, grads=wb.grads,
                          optimizer=wb.optimizer, stream_bytes=4)
    assert wide_peak.phases["optimizer step"]["NF4 input-gradient panels (nf4_matmul, per thread)"] == \
        nf4_matmul.scratch_bytes(32, 2048, nf4_matmul.team_threads(), adapter, copies_rows=True)
    assert not any("panels" in term for term in terms(on_cpu=False))  # CUDA
    with mock.patch.object(nf4_matmul, "takes_bf16_run", lambda: False):
        assert not any("panels" in term for term in terms())


GELU_SHAPES = [(1024, 2048, 512, 8), (37, 1088, 96, 2), (13, 64, 32, 0), (29, 128, 1088, 6)]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n, n_in, n_out, r", GELU_SHAPES)
def test_gelus_gradient_applied_inside_gives_the_bits_of_the_product_then_gelus_backward(n, n_in, n_out, r,
                                                                                          approximate, nf4_linear,
                                                                                          nf4_parts):
    """With gelu = (h, approximate) each value of g·W (+ grad_a·A) is rounded, multiplied by GELU's slope at h and
    rounded again: the bits minigpt.native_gelu's backward gives from the stored product (exact GELU and tanh form;
    h with NaN, ±inf and 0 among its values)."""
    from minigpt import native_gelu
    if native_gelu.kernels() is None:
        pytest.skip("minigpt.native_gelu's kernels are not built here")
    gen = torch.Generator().manual_seed(n)
    layer = nf4_linear(n_in, n_out, 32)
    dy = torch.randn(n, n_out, generator=gen).to(BF16)
    h = (torch.randn(n, n_in, generator=gen) * 3).to(BF16)
    h.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0]).to(BF16)
    adapter = (torch.randn(n, r, generator=gen).to(BF16), torch.randn(r, n_in, generator=gen)) if r else None
    want = native_gelu.kernels().backward(K.input_grad(dy, *nf4_parts(layer), n_in, adapter), h,
                                           exact=approximate == "none")
    got = K.input_grad(dy, *nf4_parts(layer), n_in, adapter, (h, approximate))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_with_gelu_the_same_bits_on_one_thread_or_many(nf4_linear, nf4_parts):
    layer = nf4_linear(288, 1088, 64)
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(300, 1088, generator=gen).to(BF16)
    adapter = (torch.randn(300, 8, generator=gen).to(BF16), torch.randn(8, 288, generator=gen))
    gelu = ((torch.randn(300, 288, generator=gen) * 2).to(BF16), "none")
    results = []
    for split in ((1, 1), (2, 1), (2, 3), (3, 7)):
        with mock.patch.object(nf4_matmul.NF4Matmul, "_threads", lambda self, m, k, n, s=split: s):
            results.append(K.input_grad(dy, *nf4_parts(layer), 288, adapter, gelu))
    for gx in results[1:]:
        assert torch.equal(gx, results[0])


def test_what_gelu_fits_and_quantized_linear_says_none_where_it_does_not(nf4_linear):
    g, h = torch.randn(4, 64).to(BF16), torch.randn(4, 128).to(BF16)
    assert nf4_matmul.gelu_fits(g, h, "none") and nf4_matmul.gelu_fits(g, h, "tanh")
    assert not nf4_matmul.gelu_fits(g, h, "sigmoid")  # not one of F.gelu's forms
    assert not nf4_matmul.gelu_fits(g, h.float(), "none")
    assert not nf4_matmul.gelu_fits(g, h[:3], "none")  # not g's rows
    assert not nf4_matmul.gelu_fits(g, torch.randn(128, 4).to(BF16).t(), "none")  # not contiguous
    layer = nf4_linear(128, 64, 64)
    frozen = tuple(layer.quantized_tensors())
    grad_a, A = torch.randn(4, 8).to(BF16), torch.randn(8, 128)
    assert layer.input_grad_adding(frozen, g, grad_a, A, (h, "none")) is not None
    assert layer.input_grad_adding(frozen, g, grad_a, A, (h.float(), "none")) is None  # the caller applies it

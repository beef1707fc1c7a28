"""miniquant.nf4_amx: an NF4 weight written into AMX's tile layout (the bits dequantize_nf4 gives, as Wᵀ and as W)
and the GEMM on AMX's tiles, against fp64 references of the same bf16 operands on ragged shapes (row tails, a panel
short of NP columns, K over the KC chunk), with and without a bias; the same bits on one thread or many; NaN
carried to its row; where layers take it (QuantizedLinear's forward and input gradient, minituner.lora_product's
forward, bf16 on a CPU with AMX, weights of at most MAX_WEIGHT values) and where not;
the shared helpers are conftest.py's fixtures."""
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from miniquant import nf4_amx, nf4_matmul
from miniquant.quantize import workspace_buffer

BF16 = torch.bfloat16
needs_amx = pytest.mark.skipif(not nf4_amx.usable(), reason="miniquant.nf4_amx needs a CPU with AMX (amx_bf16), "
                                                            "Linux's permission and a compiler that knows -mamx-tile")
# rows M, in, out, blocksize: whole panels; a row tail (M % 32) and fewer rows than a block; columns short of a
# panel (out % NP, in % NP); K over the KC chunk (1,088 = 1,024 + 64); blocks of 32 and 128
SHAPES = [(1024, 512, 512, 64), (13, 64, 32, 64), (100, 160, 96, 32), (37, 1088, 96, 32), (33, 128, 1088, 128),
          (1, 256, 64, 64)]


def unpacked(tiles: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """B (k, n) from the tiles' layout: strips of 16 columns, each k / 2 lines of 16 pairs (even k low)."""
    pairs = tiles[: k * n].view(n // 16, k // 2, 16, 2)  # strip, line, column, (even, odd)
    return pairs.permute(1, 3, 0, 2).reshape(k, n)


@needs_amx
@pytest.mark.parametrize("n_in, n_out, bs", [(512, 512, 64), (64, 32, 32), (160, 96, 128), (1088, 64, 64)])
def test_pack_writes_the_bits_dequantize_gives_in_the_tiles_layout(n_in, n_out, bs, nf4_linear, nf4_parts):
    layer = nf4_linear(n_in, n_out, bs)
    w = layer.dequantize(BF16)  # (out, in)
    tiles = torch.empty(n_out * n_in, dtype=BF16)
    nf4_amx.kernels().pack(*nf4_parts(layer), (n_out, n_in), True, tiles)
    assert torch.equal(unpacked(tiles, n_in, n_out).view(torch.int16), w.t().view(torch.int16))
    nf4_amx.kernels().pack(*nf4_parts(layer), (n_out, n_in), False, tiles)
    assert torch.equal(unpacked(tiles, n_out, n_in).view(torch.int16), w.view(torch.int16))


@needs_amx
@pytest.mark.parametrize("m, n_in, n_out, bs", SHAPES)
def test_products_match_fp64_of_the_same_bf16_operands(m, n_in, n_out, bs, nf4_linear, bf16_close, nf4_parts):
    layer = nf4_linear(n_in, n_out, bs)
    w = layer.dequantize(BF16).double()
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(m, n_in, generator=gen).to(BF16), torch.randn(m, n_out, generator=gen).to(BF16)
    bias = torch.randn(n_out, generator=gen).to(BF16)
    work = torch.empty(n_out * n_in, dtype=BF16)
    k = nf4_amx.kernels()
    y, finite = k.product(x, *nf4_parts(layer), (n_out, n_in), work, bias)
    assert y.dtype == BF16 and y.shape == (m, n_out) and finite and bf16_close(y, x.double() @ w.t() + bias.double())
    assert bf16_close(k.product(x, *nf4_parts(layer), (n_out, n_in), work)[0], x.double() @ w.t())
    gx, finite = k.product(g, *nf4_parts(layer), (n_out, n_in), work, transposed=False)
    assert gx.shape == (m, n_in) and finite and bf16_close(gx, g.double() @ w)


@needs_amx
@pytest.mark.parametrize("m, n_in, n_out, bs", SHAPES)
@pytest.mark.parametrize("r", [2, 8, 32])
def test_an_adapters_share_is_added_before_the_one_rounding(m, n_in, n_out, bs, r, nf4_linear, bf16_close, nf4_parts):
    """Forward: x·Wᵀ + b + s·a·Bᵀ (a = x·Aᵀ in bf16, B's fp32 master rounded to bf16); input gradient:
    g·W + grad_a·A; each against fp64 of the same bf16 operands, within one rounding."""
    layer = nf4_linear(n_in, n_out, bs)
    w = layer.dequantize(BF16).double()
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(m, n_in, generator=gen).to(BF16), torch.randn(m, n_out, generator=gen).to(BF16)
    a, grad_a = torch.randn(m, r, generator=gen).to(BF16), torch.randn(m, r, generator=gen).to(BF16)
    A, B = torch.randn(r, n_in, generator=gen), torch.randn(n_out, r, generator=gen)
    bias = torch.randn(n_out, generator=gen).to(BF16)
    work = torch.empty(n_out * n_in, dtype=BF16)
    k = nf4_amx.kernels()
    y, finite = k.product(x, *nf4_parts(layer), (n_out, n_in), work, bias, adapter=(a, B, 0.75))
    ref = x.double() @ w.t() + bias.double() + 0.75 * a.double() @ B.to(BF16).double().t()
    assert finite and bf16_close(y, ref)
    gx, finite = k.product(g, *nf4_parts(layer), (n_out, n_in), work, transposed=False, adapter=(grad_a, A, 1.0))
    assert finite and bf16_close(gx, g.double() @ w + grad_a.double() @ A.to(BF16).double())


@needs_amx
def test_finite_says_whether_a_value_written_is_nan_or_inf(nf4_linear, nf4_parts):
    layer = nf4_linear(64, 32, 64)
    work = torch.empty(32 * 64, dtype=BF16)
    x = torch.randn(40, 64).to(BF16)
    assert nf4_amx.kernels().product(x, *nf4_parts(layer), (32, 64), work)[1]
    x[39, 0] = float("inf")  # the last row, in the padded block
    assert not nf4_amx.kernels().product(x, *nf4_parts(layer), (32, 64), work)[1]
    B = torch.randn(32, 4)
    B[3, 1] = float("nan")
    out, finite = nf4_amx.kernels().product(torch.randn(40, 64).to(BF16), *nf4_parts(layer), (32, 64), work,
                                            adapter=(torch.randn(40, 4).to(BF16), B, 1.0))
    assert not finite and torch.isnan(out[:, 3]).all() and not torch.isnan(out[:, :3]).any()


def test_what_adapter_fits():
    g = torch.randn(10, 64).to(BF16)
    assert nf4_amx.adapter_fits(g, torch.randn(10, 8).to(BF16), torch.randn(8, 96), 96, False)
    assert nf4_amx.adapter_fits(g, torch.randn(10, 8).to(BF16), torch.randn(96, 8), 96, True)
    assert not nf4_amx.adapter_fits(g, torch.randn(10, 8).to(BF16), torch.randn(8, 96), 96, True)  # wrong layout
    assert not nf4_amx.adapter_fits(g, torch.randn(10, 7).to(BF16), torch.randn(7, 96), 96, False)  # odd rank
    assert not nf4_amx.adapter_fits(g, torch.randn(10, 34).to(BF16), torch.randn(34, 96), 96, False)  # over MAX_RANK
    assert not nf4_amx.adapter_fits(g, torch.randn(10, 8), torch.randn(8, 96), 96, False)  # fp32 grad_a
    assert not nf4_amx.adapter_fits(g, torch.randn(10, 8).to(BF16), torch.randn(8, 96).to(BF16), 96, False)


@needs_amx
def test_the_same_bits_on_one_thread_or_many(nf4_linear, nf4_parts):
    """Each output's sums run over k in order in one block, whatever the panels' split over the threads; the
    packing's split over them (its strips, or its pairs of rows) writes the same layout."""
    layer = nf4_linear(1088, 288, 64)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(300, 1088, generator=gen).to(BF16), torch.randn(300, 288, generator=gen).to(BF16)
    work = torch.empty(288 * 1088, dtype=BF16)
    adapter = (x[:, :8].contiguous(), torch.randn(288, 8), 0.5)
    results = []
    for threads in (1, 2, 3, 5):
        with mock.patch.object(nf4_amx.NF4Amx, "_threads", lambda self, units, per_thread=0, t=threads: t):
            k = nf4_amx.kernels()
            y = k.product(x, *nf4_parts(layer), (288, 1088), work, adapter=adapter)[0]
            packed_t = work.clone()  # (the weight as the forward's GEMM read it)
            gx = k.product(g, *nf4_parts(layer), (288, 1088), work, transposed=False)[0]
            results.append((y, packed_t, gx, work.clone()))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@needs_amx
def test_nan_is_carried_to_its_row_and_rows_with_a_stride_are_read_as_such(nf4_linear, bf16_close, nf4_parts):
    layer = nf4_linear(128, 64, 64)
    x = torch.randn(20, 160).to(BF16)[:, :128]  # rows 160 apart
    x[3, 5] = float("nan")
    y, finite = nf4_amx.kernels().product(x, *nf4_parts(layer), (64, 128), torch.empty(64 * 128, dtype=BF16))
    assert not finite and torch.isnan(y[3]).all() and not torch.isnan(y[torch.arange(20) != 3]).any()
    assert bf16_close(y[:3], x[:3].double() @ layer.dequantize(BF16).double().t())


@needs_amx
def test_no_rows(nf4_linear, nf4_parts):
    layer = nf4_linear(64, 32, 64)
    y, _ = nf4_amx.kernels().product(torch.empty(0, 64, dtype=BF16), *nf4_parts(layer), (32, 64),
                                     torch.empty(32 * 64, dtype=BF16))
    assert y.shape == (0, 32)


def test_what_fits(monkeypatch):
    monkeypatch.setattr(nf4_amx, "usable", lambda: True)
    x = torch.randn(4, 128).to(BF16)
    assert nf4_amx.fits(x, 128, 64, 64) and nf4_amx.fits(x, 512, 2048, 64) and nf4_amx.fits(x, 2048, 512, 64)
    assert not nf4_amx.fits(x.float(), 128, 64, 64)  # fp32: the workspace path
    assert not nf4_amx.fits(torch.randn(128, 4).to(BF16).t(), 128, 64, 64)  # columns with a stride
    assert not nf4_amx.fits(x, 2048, 1024, 64)  # a weight over MAX_WEIGHT values: oneDNN's
    assert not nf4_amx.shape_fits(128, 64, 48)  # blocks not a multiple of 32 values
    assert not nf4_amx.shape_fits(96 + 16, 64, 64) and not nf4_amx.shape_fits(128, 48, 64)  # not multiples of 32
    monkeypatch.setattr(nf4_amx, "usable", lambda: False)
    assert not nf4_amx.fits(x, 128, 64, 64)


def test_not_usable_without_the_cpus_amx(monkeypatch):
    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: False)
    assert not nf4_amx.usable()


@contextmanager
def counting_products():
    """nf4_amx's products while in the block: 'forward' (x·Wᵀ) or 'input_grad' (g·W)."""
    calls = []
    real = nf4_amx.NF4Amx.product

    def counted(self, a, *args, transposed=True, **kwargs):
        calls.append("forward" if transposed else "input_grad")
        return real(self, a, *args, transposed=transposed, **kwargs)
    with mock.patch.object(nf4_amx.NF4Amx, "product", counted):
        yield calls


@needs_amx
def test_quantized_linear_in_bf16_takes_it_both_ways_and_matches_the_workspace_path(nf4_linear, bf16_close):
    layer = nf4_linear(256, 96, 64)
    layer.compute_dtype = BF16
    x = torch.randn(2, 10, 256).to(BF16).requires_grad_()
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False), counting_products() as calls:
        y = layer(x)
        y.float().square().sum().backward()
    assert calls == ["forward", "input_grad"]
    gx, x.grad = x.grad, None
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False), \
            mock.patch.object(nf4_amx, "usable", lambda: False), counting_products() as calls:
        y_ws = layer(x)
        y_ws.float().square().sum().backward()
    assert calls == [] and bf16_close(y, y_ws.double()) and bf16_close(gx, x.grad.double())
    layer.compute_dtype = None
    with counting_products() as calls:  # fp32 compute: the workspace path
        layer(x.detach().float().requires_grad_()).square().sum().backward()
    assert calls == []


@needs_amx
def test_larger_weights_stay_with_onednn(nf4_linear):
    layer = nf4_linear(2048, 1024, 64)  # 2^21 values, over MAX_WEIGHT
    layer.compute_dtype = BF16
    x = torch.randn(64, 2048).to(BF16).requires_grad_()
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False), counting_products() as calls:
        layer(x).float().square().sum().backward()
    assert calls == []


@needs_amx
def test_amx_product_says_none_where_it_does_not_fit(nf4_linear, bf16_close):
    layer = nf4_linear(128, 64, 64)
    frozen = tuple(layer.quantized_tensors())
    x = torch.randn(8, 128).to(BF16)
    assert layer.amx_product(frozen, x.float(), None) is None  # fp32 x
    assert layer.amx_product(frozen, x, layer.bias.float()) is None  # a bias of another dtype
    assert layer.amx_product(frozen, x, None, (torch.randn(8, 40).to(BF16), torch.randn(64, 40), 1.0)) is None  # r
    y, finite = layer.amx_product(frozen, x, layer.bias.to(BF16))
    assert finite and layer.amx_fits(frozen, x, None, 32) and not layer.amx_fits(frozen, x, None, 34)
    w = layer.dequantize(BF16).double()
    assert bf16_close(y, x.double() @ w.t() + layer.bias.to(BF16).double())
    assert y.data_ptr() != workspace_buffer(1, BF16, x.device).data_ptr()  # a tensor of its own, not the workspace


@needs_amx
def test_lora_product_adds_the_adapter_inside_and_gives_the_workspace_paths_values(nf4_lora_run):
    from minituner import native_lora

    run = nf4_lora_run
    kernels = native_lora.kernels()
    thin = []
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False), \
            mock.patch.object(type(kernels), "forward_", lambda self, *a, real=type(kernels).forward_:
                              thin.append("forward_") or real(self, *a)), \
            mock.patch.object(type(kernels), "input_update_", lambda self, *a, real=type(kernels).input_update_:
                              thin.append("input_update_") or real(self, *a)):
        with counting_products() as calls:
            amx, seen = run()
        assert calls == ["forward", "input_grad"] and thin == [] and seen  # the adapter inside both products
        with mock.patch.object(nf4_amx, "usable", lambda: False), counting_products() as calls:
            workspace, _ = run()
        assert calls == [] and thin == ["forward_", "input_update_"]
    for a, b in zip(amx, workspace):  # each path rounds (y once here, twice there): two roundings apart at most
        assert torch.allclose(a.double(), b.double(), rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_the_planner_counts_each_threads_sums_where_it_runs():
    """Each thread that runs the GEMM keeps 64 KiB in thread-local memory (a panel's fp32 sums): the planner counts
    it per thread of the team in a bf16 QLoRA run on a CPU where nf4_amx runs, and nowhere else (mocked both
    ways)."""
    from minigpt.model import GPTConfig
    from minituner.planner import MemoryConfig, Regime, minigpt_shape, regime_bytes
    from minituner.planner.peak import step_peak

    term = "NF4 AMX GEMM sums (nf4_amx, per thread)"
    assert nf4_amx.scratch_bytes(2) == 2 * 64 * 1024

    def terms(d_model=64, regime="qlora", **kw):
        shape = minigpt_shape(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=d_model))
        cfg = MemoryConfig(batch_size=2, seq_len=16, full_precision="fp32", activations="exact", dtype="fp32")
        b = regime_bytes(shape, Regime(regime, 4), "all-linear", cfg)
        return step_peak(shape, regime, 4, "all-linear", 2, 16, 2, weights=b.weights, grads=b.grads,
                         optimizer=b.optimizer, stream_bytes=4, **kw).phases["optimizer step"]

    with mock.patch.object(nf4_amx, "takes_bf16_run", lambda: True):
        assert terms()[term] == nf4_amx.scratch_bytes(nf4_matmul.team_threads())
        assert term not in terms(on_cpu=False) and term not in terms(regime="lora")  # CUDA; no NF4 weight
        assert term not in terms(d_model=1056)  # every weight over MAX_WEIGHT (2^20 values): oneDNN's
    with mock.patch.object(nf4_amx, "takes_bf16_run", lambda: False):
        assert term not in terms()

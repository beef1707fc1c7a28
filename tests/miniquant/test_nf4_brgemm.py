"""miniquant.nf4_brgemm: a large NF4 weight's bf16 products, unpacked panel by panel into oneDNN's brgemm layout and
multiplied by PyTorch's brgemm: the bits of nf4_amx's GEMM (both sum each output over k in order on AMX's tiles)
on ragged shapes (a panel short of NP columns, k over the KC chunk, rows over MB, one row), with and without a
bias, and fp64 references of the same bf16 operands; the same bits on one thread or many; NaN carried to its
row; where layers take it (QuantizedLinear's forward and input gradient, minituner.lora_product, bf16 on a CPU
with AMX, weights of more than nf4_amx.MAX_WEIGHT values, at most MB rows) and where not; PyTorch's brgemm
looked up (minikernels.onednn_brgemm) and its absence; the planner's buffers for it."""
import ctypes
import os
import subprocess
import sys
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from minikernels import onednn_brgemm
from miniquant import nf4_amx, nf4_brgemm, nf4_matmul
from miniquant.quantize import release_workspace, workspace_bytes

BF16 = torch.bfloat16
needs_brgemm = pytest.mark.skipif(not nf4_brgemm.usable(), reason="miniquant.nf4_brgemm needs a CPU with AMX "
                                                                  "(amx_bf16) and PyTorch's brgemm")
# rows M, in, out, blocksize: whole panels and k chunks; out and in short of a panel (NP = 256) and k over the KC
# chunk (1,088 = 1,024 + 64) either way; rows over MB (512) and a row tail; one row; blocks of 32 and 128
SHAPES = [(64, 1024, 512, 64), (37, 1088, 288, 32), (600, 288, 1088, 128), (1, 320, 1056, 64), (513, 96, 64, 64)]


def amx_bits(a, layer, parts, transposed, bias=None):
    """nf4_amx's product of a with the layer's weight: the same sums in the same order."""
    out, n_in = layer.out_features, layer.in_features
    return nf4_amx.kernels().product(a, *parts, (out, n_in), torch.empty(out * n_in, dtype=BF16), bias,
                                     transposed=transposed)[0]


@needs_brgemm
@pytest.mark.parametrize("m, n_in, n_out, bs", SHAPES)
def test_products_give_nf4_amx_bits_and_match_fp64(m, n_in, n_out, bs, nf4_linear, nf4_parts, bf16_close):
    layer = nf4_linear(n_in, n_out, bs)
    parts = nf4_parts(layer)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(m, n_in, generator=gen).to(BF16), torch.randn(m, n_out, generator=gen).to(BF16)
    bias = torch.randn(n_out, generator=gen).to(BF16)
    k = nf4_brgemm.kernels()
    y, finite = k.product(x, *parts, (n_out, n_in), bias)
    assert y.dtype == BF16 and y.shape == (m, n_out) and finite
    assert torch.equal(y, amx_bits(x, layer, parts, True, bias))
    w = layer.dequantize(BF16).double()
    assert bf16_close(y, x.double() @ w.t() + bias.double())
    assert torch.equal(k.product(x, *parts, (n_out, n_in))[0], amx_bits(x, layer, parts, True))
    gx, finite = k.product(g, *parts, (n_out, n_in), transposed=False)
    assert gx.shape == (m, n_in) and finite and torch.equal(gx, amx_bits(g, layer, parts, False))
    assert bf16_close(gx, g.double() @ w)


@needs_brgemm
@pytest.mark.parametrize("m, n_in, n_out, bs", SHAPES)
def test_an_adapters_share_added_before_the_rounding_gives_nf4_amx_bits(m, n_in, n_out, bs, nf4_linear,
                                                                        nf4_parts, bf16_close):
    """x·Wᵀ + b + s·a·Bᵀ (B (out, r)) and g·W + grad_a·A (A (r, in)), the masters rounded to bf16: nf4_amx's
    bits."""
    layer = nf4_linear(n_in, n_out, bs)
    parts = nf4_parts(layer)
    gen = torch.Generator().manual_seed(3)
    w = layer.dequantize(BF16).double()
    k = nf4_brgemm.kernels()
    for r, transposed in ((16, True), (2, True), (32, False), (8, False)):
        n_k, n = (n_in, n_out) if transposed else (n_out, n_in)
        a = torch.randn(m, n_k, generator=gen).to(BF16)
        xa = torch.randn(m, r, generator=gen).to(BF16)
        wa = torch.randn(*((n, r) if transposed else (r, n)), generator=gen)
        bias = torch.randn(n, generator=gen).to(BF16) if transposed else None
        got, finite = k.product(a, *parts, (n_out, n_in), bias, transposed, adapter=(xa, wa, 0.75))
        ref = nf4_amx.kernels().product(a, *parts, (n_out, n_in), torch.empty(n_out * n_in, dtype=BF16), bias,
                                        transposed=transposed, adapter=(xa, wa, 0.75))[0]
        assert finite and torch.equal(got, ref)
        share = xa.double() @ (wa.to(BF16).double().t() if transposed else wa.to(BF16).double())
        base = a.double() @ (w.t() if transposed else w) + (0 if bias is None else bias.double())
        assert bf16_close(got, base + 0.75 * share)
        assert not torch.equal(got, k.product(a, *parts, (n_out, n_in), bias, transposed)[0])


@needs_brgemm
def test_the_same_bits_on_one_thread_or_many(nf4_linear, nf4_parts):
    """Each output's sums run over k in order within its panel, whatever the panels' split over the threads."""
    layer = nf4_linear(1088, 800, 64)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(300, 1088, generator=gen).to(BF16), torch.randn(300, 800, generator=gen).to(BF16)
    results = []
    for threads in (1, 2, 3):
        with mock.patch.object(nf4_brgemm.NF4Brgemm, "_threads", lambda self, macs, panels, t=threads: t):
            k = nf4_brgemm.kernels()
            results.append((k.product(x, *nf4_parts(layer), (800, 1088))[0],
                            k.product(g, *nf4_parts(layer), (800, 1088), transposed=False)[0]))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@needs_brgemm
def test_nan_is_carried_to_its_row_and_rows_with_a_stride_are_read_as_such(nf4_linear, nf4_parts, bf16_close):
    layer = nf4_linear(128, 64, 64)
    x = torch.randn(20, 160).to(BF16)[:, :128]  # rows 160 apart
    x[3, 5] = float("nan")
    y, finite = nf4_brgemm.kernels().product(x, *nf4_parts(layer), (64, 128))
    assert not finite and torch.isnan(y[3]).all() and not torch.isnan(y[torch.arange(20) != 3]).any()
    assert bf16_close(y[:3], x[:3].double() @ layer.dequantize(BF16).double().t())
    y, finite = nf4_brgemm.kernels().product(torch.full((2, 128), 3e38).to(BF16), *nf4_parts(layer), (64, 128))
    assert not finite  # sums past bf16's range: inf


@needs_brgemm
def test_no_rows_and_the_products_alone(nf4_linear, nf4_parts):
    layer = nf4_linear(64, 32, 64)
    k = nf4_brgemm.kernels()
    assert k.product(torch.empty(0, 64, dtype=BF16), *nf4_parts(layer), (32, 64))[0].shape == (0, 32)
    # unpack=False (the bench's floor): the same products on whatever the buffers hold, outputs of the same shape
    y, _ = k.product(torch.randn(8, 64).to(BF16), *nf4_parts(layer), (32, 64), unpack=False)
    assert y.shape == (8, 32) and y.dtype == BF16


def test_what_fits(monkeypatch):
    monkeypatch.setattr(nf4_brgemm, "usable", lambda: True)
    x = torch.randn(4, 2048).to(BF16)
    assert nf4_brgemm.fits(x, 2048, 1024, 64) and nf4_brgemm.fits(x, 2048, 8192, 64)
    assert nf4_brgemm.fits(torch.randn(512, 2048).to(BF16), 2048, 1024, 64)
    assert not nf4_brgemm.fits(torch.randn(513, 2048).to(BF16), 2048, 1024, 64)  # over MB rows: the workspace's
    assert not nf4_brgemm.fits(x, 2048, 512, 64)  # 2^20 values: nf4_amx's
    assert not nf4_brgemm.fits(x.float(), 2048, 1024, 64)  # fp32: the workspace path
    assert not nf4_brgemm.fits(torch.randn(2048, 4).to(BF16).t(), 2048, 1024, 64)  # columns with a stride
    assert not nf4_brgemm.shape_fits(2048, 1024, 48)  # blocks not a multiple of 32 values
    assert not nf4_brgemm.shape_fits(2048 + 16, 1024, 64) and not nf4_brgemm.shape_fits(2048, 1024 + 16, 64)
    monkeypatch.setattr(nf4_brgemm, "usable", lambda: False)
    assert not nf4_brgemm.fits(x, 2048, 1024, 64)


def test_not_usable_without_the_cpus_amx_or_pytorchs_brgemm(monkeypatch):
    with mock.patch.object(onednn_brgemm, "brgemm_bf16", lambda: None):
        assert not nf4_brgemm.usable()
    monkeypatch.setattr(nf4_matmul, "cpu_has_amx", lambda: False)
    assert not nf4_brgemm.usable()


def test_pytorchs_brgemm_is_looked_up_by_name_and_none_where_missing():
    onednn_brgemm._functions.cache_clear()
    try:
        found = onednn_brgemm.brgemm_bf16()
        if nf4_matmul.cpu_has_amx():  # PyTorch's CPU wheels ship it; its oneDNN packs bf16 for AMX's brgemm
            assert found is not None and all(isinstance(a, int) and a for a in found)
        onednn_brgemm._functions.cache_clear()
        with mock.patch.object(onednn_brgemm, "BRGEMM_BF16", "no_such_symbol"):
            assert onednn_brgemm.brgemm_bf16() is None
        onednn_brgemm._functions.cache_clear()
        with mock.patch.object(onednn_brgemm, "library_path", lambda: "/nonexistent/libtorch_cpu.so"):
            assert onednn_brgemm.brgemm_bf16() is None
    finally:
        onednn_brgemm._functions.cache_clear()


@needs_brgemm
def test_onednn_switched_off_turns_it_off_for_the_while():
    """PyTorch's brgemm throws (a C++ exception: the process would end inside our C) for the VNNI layout while
    oneDNN is off: fits says no then, and yes again after. In a process of its own, so a regression fails this
    test instead of ending the session."""
    code = """
import torch
from miniquant import nf4_brgemm
from miniquant.quantize import QuantizedLinear
lin = QuantizedLinear.from_linear(torch.nn.Linear(1056, 1024), "nf4_per_group_64")
lin.compute_dtype = torch.bfloat16
x = torch.randn(8, 1056).to(torch.bfloat16)
y = lin(x)
with torch.backends.mkldnn.flags(enabled=False):
    assert not nf4_brgemm.fits(x, 1056, 1024, 64)
    y_off = lin(x)
assert nf4_brgemm.fits(x, 1056, 1024, 64) and torch.equal(lin(x), y)
print("ok", y_off.shape)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


BRGEMM_SIGNATURE = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 6, ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_bool)


@needs_brgemm
def test_brgemm_is_asked_for_whole_blocks_of_32_rows_and_the_same_calls_without_unpacking(nf4_linear, nf4_parts):
    """Every brgemm call the C makes, recorded through a stand-in (one thread): only multiples of 32 rows (the last
    rows padded), so row counts 1..200 ask for a handful of shapes, not one per count; the bench's floor
    (unpack=False) makes exactly the calls a product makes."""
    calls = []
    record = BRGEMM_SIGNATURE(lambda m, n, k, lda, ldb, ldc, add, a, b, c, vnni: calls.append((m, n, k, lda, add)))
    release = ctypes.CFUNCTYPE(None, ctypes.c_bool)(lambda vnni: None)
    layer = nf4_linear(1088, 288, 64)
    pointers = (ctypes.cast(record, ctypes.c_void_p).value, ctypes.cast(release, ctypes.c_void_p).value)
    with mock.patch.object(onednn_brgemm, "brgemm_bf16", lambda: pointers), \
            mock.patch.object(nf4_brgemm.NF4Brgemm, "_threads", lambda self, macs, panels: 1):
        k = nf4_brgemm.kernels()
        shapes = set()
        for m in range(1, 201):
            calls.clear()
            k.product(torch.randn(m, 1088).to(BF16), *nf4_parts(layer), (288, 1088))
            assert calls and all(c[0] % 32 == 0 and 0 < c[0] <= nf4_brgemm.MB for c in calls)
            assert sum(c[0] for c in calls if not c[4]) == -(-m // 32) * 32 * 2  # 2 panels (256 + 32), rows once
            shapes |= set(calls)
        assert len(shapes) <= 2 * 2 * 2 * 8  # panels x k chunks (1,024 + 64) x add_C x whole-block row counts
        x = torch.randn(70, 1088).to(BF16)
        calls.clear()
        k.product(x, *nf4_parts(layer), (288, 1088))
        made = list(calls)
        calls.clear()
        k.product(x, *nf4_parts(layer), (288, 1088), unpack=False)
        assert calls == made
        # an adapter: one more call per panel and block of rows, over its 32 values (r padded), from 0
        adapter = (torch.randn(70, 8).to(BF16), torch.randn(288, 8), 0.5)
        calls.clear()
        k.product(x, *nf4_parts(layer), (288, 1088), adapter=adapter)
        assert [c for c in calls if c[2] == nf4_brgemm.ADAPTER_K] == [(96, 256, 32, 32, False), (96, 32, 32, 32, False)]
        assert [c for c in calls if c[2] != nf4_brgemm.ADAPTER_K] == made
        made = list(calls)
        calls.clear()
        k.product(x, *nf4_parts(layer), (288, 1088), adapter=adapter, unpack=False)
        assert calls == made


@contextmanager
def counting_products():
    """nf4_brgemm's products while in the block: 'forward' (x·Wᵀ) or 'input_grad' (g·W)."""
    calls = []
    real = nf4_brgemm.NF4Brgemm.product

    def counted(self, a, packed, absmax, blocksize, shape, bias=None, transposed=True, adapter=None, unpack=True):
        calls.append(("forward" if transposed else "input_grad") + ("+adapter" if adapter is not None else ""))
        return real(self, a, packed, absmax, blocksize, shape, bias, transposed, adapter, unpack)
    with mock.patch.object(nf4_brgemm.NF4Brgemm, "product", counted):
        yield calls


@needs_brgemm
def test_quantized_linear_in_bf16_takes_it_both_ways_and_matches_the_workspace_path(nf4_linear, nf4_parts):
    layer = nf4_linear(1056, 1024, 64)  # 1,081,344 values: over nf4_amx's MAX_WEIGHT
    layer.compute_dtype = BF16
    x = torch.randn(2, 10, 1056).to(BF16).requires_grad_()
    release_workspace()
    with counting_products() as calls:
        y = layer(x)
        y.float().square().sum().backward()
    assert calls == ["forward", "input_grad"] and workspace_bytes() == 0  # (what the planner counts)
    parts = nf4_parts(layer)
    assert torch.equal(y.view(20, 1024), amx_bits(x.detach().view(20, 1056), layer, parts, True,
                                                    layer.bias.to(BF16)))
    g = (2 * y.float()).to(BF16).view(20, 1024)  # d(sum y²)/dy, rounded as the backward's bf16 gradient is
    assert torch.equal(x.grad.view(20, 1056), amx_bits(g, layer, parts, False))
    with mock.patch.object(nf4_brgemm, "usable", lambda: False), counting_products() as calls:
        y_ws = layer(x)  # the workspace path: dequantized, then oneDNN's matmul
    assert calls == [] and torch.allclose(y.float(), y_ws.float(), rtol=2**-7, atol=2**-7 * y.abs().max().item())
    layer.compute_dtype = None
    with counting_products() as calls:  # fp32 compute: the workspace path
        layer(x.detach().float())
    assert calls == []


@needs_brgemm
def test_more_rows_than_mb_and_smaller_weights_go_elsewhere(nf4_linear):
    layer = nf4_linear(1056, 1024, 64)
    layer.compute_dtype = BF16
    with counting_products() as calls:
        layer(torch.randn(nf4_brgemm.MB + 1, 1056).to(BF16).requires_grad_()).float().sum().backward()
    assert calls == []
    small = nf4_linear(1024, 1024, 64)  # 2^20 values: nf4_amx's
    small.compute_dtype = BF16
    with counting_products() as calls:
        small(torch.randn(8, 1024).to(BF16).requires_grad_()).float().sum().backward()
    assert calls == []


@needs_brgemm
def test_lora_product_on_a_large_nf4_base_takes_it_and_gives_the_workspace_paths_values(nf4_linear, nf4_parts):
    from minituner import lora_product, native_lora
    from minituner.lora import LoRALinear

    base = nf4_linear(1056, 1024, 64)
    base.compute_dtype = BF16
    lora = LoRALinear(base, r=8, alpha=16)
    lora.compute_dtype = BF16
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_(0, 0.1, generator=gen)
    x = torch.randn(64, 1056, generator=gen).to(BF16)
    assert lora_product.fused_fits(lora, x, "default")

    def run():
        for p in lora.parameters():
            p.grad = None
        xr = x.clone().requires_grad_()
        y = lora(xr)
        y.float().square().mean().backward()
        return y, xr.grad, lora.lora_A["default"].weight.grad, lora.lora_B["default"].weight.grad
    with counting_products() as calls:
        got = run()
    assert calls == ["forward+adapter", "input_grad+adapter"]  # the adapter's share inside, rounded once
    parts = nf4_parts(base)
    A, B = lora.lora_A["default"].weight.detach(), lora.lora_B["default"].weight.detach()
    a = native_lora.kernels().down(x, A)  # x·Aᵀ (64, r), as the forward makes it
    workspace = torch.empty(1024 * 1056, dtype=BF16)
    assert torch.equal(got[0], nf4_amx.kernels().product(x, *parts, (1024, 1056), workspace, base.bias.to(BF16),
                                                         adapter=(a, B, 2.0))[0])
    with mock.patch.object(nf4_brgemm, "usable", lambda: False), counting_products() as calls:
        ref = run()
    assert calls == []
    for a, b in zip(got, ref):  # the same operands; the sums' order differs from oneDNN's
        assert torch.allclose(a.float(), b.float(), rtol=2**-6, atol=2**-6 * b.abs().max().item())


@pytest.mark.parametrize("rows, brgemm", [(nf4_brgemm.MB, True), (nf4_brgemm.MB + 8, False)])
def test_the_planner_counts_its_buffers_instead_of_the_workspace(monkeypatch, rows, brgemm):
    """A bf16 QLoRA step on a CPU where both AMX products run: the MLP's 2,048 x 1,024 weights (over 2^20 values)
    unpacked inside nf4_brgemm's product, so the workspace is only the attention's 1,024 x 1,024 (nf4_amx's); with
    more rows than MB, the workspace of the largest, and no buffers of nf4_brgemm."""
    from minituner.hf_config import decoder_config_from_hf
    from minituner.planner import MemoryConfig, Regime, regime_bytes
    from minituner.planner import activations
    from minituner.planner.activations import PRECISION_WIDTHS
    from minituner.planner.hf import decoder_shape
    from minituner.planner.peak import step_peak

    monkeypatch.setattr(nf4_brgemm, "takes_bf16_run", lambda: True)
    monkeypatch.setattr(nf4_amx, "takes_bf16_run", lambda: True)
    assert activations.bf16_compute_nf4_brgemm(2, 4, rows) == brgemm
    assert not activations.bf16_compute_nf4_brgemm(4, 4, 64)  # fp32 compute
    assert not activations.bf16_compute_nf4_brgemm(2, 4, 64, on_cpu=False)
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 1024, "intermediate_size": 2048,
              "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
              "max_position_embeddings": 1024}
    shape = decoder_shape(decoder_config_from_hf(config))
    cfg = MemoryConfig(batch_size=1, seq_len=rows, full_precision="fp32", activations="exact", dtype="fp32")
    b = regime_bytes(shape, Regime("qlora", 8), "all-linear", cfg)
    peak = step_peak(shape, "qlora", 8, "all-linear", 1, rows, weights=b.weights, grads=b.grads,
                     optimizer=b.optimizer, **PRECISION_WIDTHS["bf16"])
    for terms in peak.phases.values():
        assert terms["NF4 dequantization workspace"] == (1024 * 1024 if brgemm else 2048 * 1024) * 2
        assert terms.get("NF4 brgemm panels (nf4_brgemm, per thread)") == (
            nf4_brgemm.scratch_bytes(nf4_matmul.team_threads(), 2048) if brgemm else None)

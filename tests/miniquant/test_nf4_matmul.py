"""miniquant.nf4_matmul: an NF4 weight's input gradient g·W with bf16 g, the codes unpacked inside the product
(AVX512-BF16), against fp64 references of the same bf16 operands on ragged shapes (row tails, column units short of
NB, K over the KC chunk); the same bits on one thread or many; NaN carried; where it is used (QuantizedLinear and
minituner.lora_product, bf16 on CPU) and where not; and how minituner.planner counts its buffers."""
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch

from miniquant import nf4_matmul
from miniquant.quantize import QuantizedLinear

pytestmark = pytest.mark.skipif(nf4_matmul.kernels() is None,
                                reason="miniquant.nf4_matmul needs AVX512-BF16 and a C compiler")
BF16 = torch.bfloat16
K = nf4_matmul.kernels()
# rows N, in, out, blocksize: full microkernel rows and units, a row tail (N % 14), fewer rows than one
# microkernel, a column unit short of NB (in % 128), K = out over KC (576 = 512 + 64; 1088), blocks of 32 and 128
SHAPES = [(1024, 512, 512, 64), (13, 64, 32, 64), (100, 160, 576, 32), (37, 1088, 96, 32), (29, 128, 1088, 128),
          (1, 256, 64, 64)]


def quantized(n_in: int, n_out: int, blocksize: int, seed: int = 0, bias: bool = True) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    return QuantizedLinear.from_linear(lin, f"nf4_per_group_{blocksize}")


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one bf16 rounding of each value (relative), or of the largest for values near 0."""
    return torch.allclose(got.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())


def parts(layer: QuantizedLinear):
    packed, absmax = layer.quantized_tensors()
    return packed, absmax, layer._scheme.group_size


@pytest.mark.parametrize("n, n_in, n_out, bs", SHAPES)
def test_input_grad_matches_fp64_of_the_same_bf16_operands(n, n_in, n_out, bs):
    layer = quantized(n_in, n_out, bs)
    w = layer.dequantize(BF16).double()  # the values the workspace path multiplies
    dy = torch.randn(n, n_out, generator=torch.Generator().manual_seed(1)).to(BF16)
    gx = K.input_grad(dy, *parts(layer), n_in)
    assert gx.dtype == BF16 and gx.shape == (n, n_in)
    assert close(gx, dy.double() @ w)


def test_the_same_bits_on_one_thread_or_many():
    """Each output value is summed by one thread in k order, whatever the split into column units and row groups."""
    layer = quantized(288, 1088, 64)
    dy = torch.randn(300, 1088, generator=torch.Generator().manual_seed(2)).to(BF16)
    results = []
    for split in ((1, 1), (2, 1), (2, 3), (3, 7)):
        with mock.patch.object(nf4_matmul.NF4Matmul, "_threads", lambda self, m, k, n, s=split: s):
            results.append(K.input_grad(dy, *parts(layer), 288))
    for gx in results[1:]:
        assert torch.equal(gx, results[0])


def test_nan_is_carried_to_its_row_and_rows_with_a_stride_are_read_as_such():
    layer = quantized(128, 64, 64)
    dy = torch.randn(20, 96).to(BF16)[:, :64]  # rows 96 apart
    dy[3, 5] = float("nan")
    gx = K.input_grad(dy, *parts(layer), 128)
    assert torch.isnan(gx[3]).all() and not torch.isnan(gx[torch.arange(20) != 3]).any()
    assert gx.view(torch.int16)[3, 0].item() == 0x7FC0  # as PyTorch rounds a NaN to bf16
    assert close(gx[:3], dy[:3].double() @ layer.dequantize(BF16).double())


def test_no_rows():
    layer = quantized(64, 32, 64)
    assert K.input_grad(torch.empty(0, 32, dtype=BF16), *parts(layer), 64).shape == (0, 64)


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
                calls.append(name)
                return real(self, *args)
            stack.enter_context(mock.patch.object(nf4_matmul.NF4Matmul, name, counted))
        yield calls


def test_quantized_linear_in_bf16_takes_it_backward_and_matches_the_workspace_path():
    layer = quantized(256, 96, 64)
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
    assert close(y, y_ws.double()) and close(gx, x.grad.double())
    layer.compute_dtype = None
    with counting_calls() as calls:  # fp32 compute: the workspace path
        layer(x.detach().float().requires_grad_()).square().sum().backward()
    assert calls == []


def test_lora_product_takes_it_and_gives_the_workspace_paths_gradients():
    from minituner import lora_product
    from minituner.lora import LoRALinear

    base = quantized(512, 256, 64)
    base.compute_dtype = BF16
    lora = LoRALinear(base, r=8, alpha=16)
    lora.compute_dtype = BF16
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_(0, 0.1)
    x = torch.randn(64, 512).to(BF16)
    assert lora_product.fused_fits(lora, x, "default")  # base and adapter as one Function

    def run():
        for p in lora.parameters():
            p.grad = None
        xr = x.clone().requires_grad_()
        y = lora(xr)
        y.float().square().mean().backward()
        return y, xr.grad, lora.lora_A["default"].weight.grad, lora.lora_B["default"].weight.grad

    with counting_calls() as calls:
        fused = run()
    assert calls == ["input_grad"]
    with mock.patch.object(nf4_matmul, "fits", lambda *a, **k: False):
        workspace = run()
    for a, b in zip(fused, workspace):
        assert close(a, b.double())


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
    assert here["NF4 input-gradient panels (nf4_matmul, per thread)"] == nf4_matmul.scratch_bytes(
        32, 256, nf4_matmul.team_threads())  # K = out_features, at most fc1's 256
    assert nf4_matmul.scratch_bytes(32, 256, 2) == 2 * 128 * 256 * 2  # K within KC: the panel alone
    assert nf4_matmul.scratch_bytes(32, 1024, 1) == 128 * 512 * 2 + (32 + 14) * 128 * 4  # and the fp32 sums
    assert not any("panels" in term for term in terms(on_cpu=False))  # CUDA
    with mock.patch.object(nf4_matmul, "takes_bf16_run", lambda: False):
        assert not any("panels" in term for term in terms())

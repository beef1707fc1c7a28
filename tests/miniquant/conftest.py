"""Fixtures shared by the NF4 product tests (test_nf4_matmul.py, test_nf4_amx.py): a seeded NF4 layer, its
buffers as the kernels take them, and the one-rounding comparison against an fp64 reference."""
import pytest
import torch

from miniquant.quantize import QuantizedLinear


def _nf4_linear(n_in: int, n_out: int, blocksize: int, seed: int = 0, bias: bool = True) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    return QuantizedLinear.from_linear(lin, f"nf4_per_group_{blocksize}")


def _bf16_close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one bf16 rounding of each value (relative), or of the largest for values near 0."""
    return torch.allclose(got.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())


def _nf4_parts(layer: QuantizedLinear):
    packed, absmax = layer.quantized_tensors()
    return packed, absmax, layer._scheme.group_size


@pytest.fixture
def nf4_linear():
    """(n_in, n_out, blocksize, seed=0, bias=True) -> a QuantizedLinear of NF4 codes from seeded weights (x 0.05)."""
    return _nf4_linear


@pytest.fixture
def bf16_close():
    """(got, ref fp64) -> whether got is within one bf16 rounding of ref."""
    return _bf16_close


@pytest.fixture
def nf4_parts():
    """layer -> (packed codes, absmax, blocksize), as the kernels take them."""
    return _nf4_parts


@pytest.fixture
def nf4_lora_run(nf4_linear):
    """A bf16 LoRALinear (r 8, B nonzero) on a 512 -> 256 NF4 layer that lora_product fuses, and run(): a fresh
    forward and backward of it on one (64, 512) batch -> ((y, x's, A's and B's gradients), y seen finite)."""
    from minituner import lora_product
    from minituner.lora import LoRALinear

    base = nf4_linear(512, 256, 64)
    base.compute_dtype = torch.bfloat16
    lora = LoRALinear(base, r=8, alpha=16)
    lora.compute_dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1)  # (not the global generator: the same values whatever ran before)
    with torch.no_grad():
        lora.lora_A["default"].weight.copy_(torch.randn(8, 512, generator=g) * 512 ** -0.5)
        lora.lora_B["default"].weight.normal_(0, 0.1, generator=g)
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    assert lora_product.fused_fits(lora, x, "default")  # base and adapter as one Function

    def run():
        for p in lora.parameters():
            p.grad = None
        xr = x.clone().requires_grad_()
        y = lora(xr)
        seen = lora.output_seen_finite(y)
        y.float().square().mean().backward()
        return (y, xr.grad, lora.lora_A["default"].weight.grad, lora.lora_B["default"].weight.grad), seen
    return run

"""minikernels.bf16_exp's TAIL16: the activation kernels give a value the same bits wherever it sits in its tensor.

Before, a kernel's last n < 16 values (of the tensor, or of a thread's chunk) went through a scalar twin of the
16-lane code whose σ was computed another way, and a few values came out one bf16 unit apart (SwiGLU's forward
at g = -3.05 and 5.94; GELU's at -10, where σ underflows: 1e-37 against the vector's and PyTorch's -0).
"""
import pytest
import torch

from minigpt import native_gelu, native_swiglu

EVERY_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # 65,536 patterns


def _gelu(k, x, other):
    return k.forward(x), k.backward(other, x)


def _gelu_exact(k, x, other):
    return (k.backward(other, x, exact=True),)


def _swiglu(k, x, other):
    return (k.forward(x, other),) + k.backward(other, x, other, True, True)


KERNELS = {"gelu": (native_gelu.kernels(), _gelu), "gelu_exact": (native_gelu.kernels(), _gelu_exact),
           "swiglu": (native_swiglu.kernels(), _swiglu)}


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_value_gives_the_same_bits_in_a_tail_as_in_the_16_lane_body(name, one_thread):
    k, outputs = KERNELS[name]
    if k is None:
        pytest.skip("no C compiler or no AVX-512: the kernels are not used")
    x = EVERY_BF16.contiguous()
    other = torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    body = outputs(k, x, other)  # 65,536 values: 4,096 blocks of 16, no tail
    pieces = [outputs(k, x[i:i + 15].contiguous(), other[i:i + 15].contiguous()) for i in range(0, x.numel(), 15)]
    for whole, tails in zip(body, zip(*pieces)):  # each output: every value computed in a tail of 15
        assert torch.equal(whole.view(torch.int16), torch.cat(tails).view(torch.int16))

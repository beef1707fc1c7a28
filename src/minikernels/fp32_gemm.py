"""fp32 products of a Linear on CPU, through oneDNN where PyTorch's default library is slow.

    y = linear(x, weight, bias)   # F.linear: x·Wᵀ + b, with the gradients autograd asks for

PyTorch's CPU wheels compute an fp32 ``mm`` with MKL's sgemm. MKL picks its code by the CPU's vendor, and on
a CPU not made by Intel it runs its AVX2 kernels even where the CPU has AVX-512. oneDNN, which PyTorch ships
too (it runs the bf16 products), picks its kernels by the instruction sets the CPU reports. On the AMD EPYC
of benchmarks/RESULTS.md (AVX-512, 2 cores), forward products at Llama-1B shapes and 512 tokens ran at about
200 GFLOP/s through ``F.linear`` and about 460 through oneDNN, and the input gradient likewise; at MiniGPT's
sizes (64-wide) the two take the same time. On an AMD CPU without AVX-512 both libraries run AVX2 code, and
there MKL is the faster: on an AMD EPYC (Zen 3, 2 cores), the products of a Llama-1B-shaped step (512
tokens, forward and input gradients, timed alone) took 15.0 s through ``F.linear`` and 17.4 s through oneDNN,
those of the bench's GPT-shaped stack 0.65 s and 0.72 s.

The arithmetic is the same: IEEE fp32 multiply-adds (oneDNN converts to bf16 only when PyTorch's fp32
precision setting allows it, which it does not by default). The results differ from MKL's in rounding only,
by the order of the sums (a few units in the 6th significant digit at 2,048-long dot products).

Which library: ``backend()``. On x86 CPUs of other vendors (AMD, Hygon) that have AVX-512 oneDNN, elsewhere
PyTorch's own (``F.linear``: MKL on Intel, where it takes its AVX-512 kernels, and on AVX2-only CPUs).
``MINIKERNELS_FP32_GEMM=onednn`` or ``=aten`` forces one. Only fp32 on CPU takes oneDNN here; everything else
(bf16, CUDA) is ``F.linear`` as before (``minituner.lora_product`` calls ``onednn_linear`` itself for a bf16 base
product with a bias, which oneDNN adds inside its kernel, where oneDNN takes bf16: ``onednn_bf16_available``).

Gradients, each one product: for x, grad_y·W through backend()'s library (oneDNN reads W transposed, as a view);
for a trainable W (full fine-tuning), grad_yᵀ·x by ``torch.mm``, which reads the transposed grad_y as it is: oneDNN
would first copy grad_yᵀ (tokens·out·4 bytes that ``minituner.planner`` does not count; with that copy a full
fine-tuning step of the bench's GPT-shaped stack took 0.57× F.linear's time, without it 0.70×, measured side by
side); for a trainable bias, the sum of grad_y over the tokens. Autograd keeps what it keeps for F.linear: x when W
trains, W when x needs a gradient. Like the frozen path before it, the Function is differentiable once (no
``create_graph`` through it); under CPU autocast, and for an empty batch, ``F.linear`` runs.

A trainable fp32 weight takes this Function on either library (the forward and x's gradient then F.linear's
products where ``backend()`` is aten), for its weight gradient: F.linear's autograd hands W's gradient on as
the transpose of a (in, out) product, a view, and where one weight gets two gradients (an embedding tied to
the head) autograd cannot add the second into a view in place and makes a third (vocab × d_model × 4 bytes,
98 MiB at 50,000 × 512, which ``minituner.planner`` does not count); grad_yᵀ·x is a fresh tensor, added into
in place. So a full fine-tune's Linears are differentiable once on every CPU (nothing here differentiates twice;
a caller that needs ``create_graph`` through them calls ``F.linear``).
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import parse_cpu_flags

BACKEND_ENV = "MINIKERNELS_FP32_GEMM"  # "onednn" or "aten" forces the library; unset or "auto": by vendor
BACKENDS = ("onednn", "aten")
ONEDNN_VENDORS = ("AuthenticAMD", "HygonGenuine")  # x86 vendors for which MKL takes its AVX2 path, AVX-512 or not
CPUINFO = Path("/proc/cpuinfo")


def cpu_vendor(cpuinfo: str) -> str:
    """The vendor_id of the first CPU in a /proc/cpuinfo text ('' when it names none, e.g. on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def cpu_has_avx512(cpuinfo: str) -> bool:
    """Whether the first CPU of a /proc/cpuinfo text lists avx512f among its flags."""
    return "avx512f" in parse_cpu_flags(cpuinfo)


def choose_backend(vendor: str, forced: str | None, onednn_available: bool, avx512: bool) -> str:
    """The library for fp32 products: `forced` when set (and oneDNN is there), else by vendor and AVX-512."""
    if forced not in (None, "", "auto", *BACKENDS):
        raise ValueError(f"{BACKEND_ENV} must be one of auto, {', '.join(BACKENDS)}, got {forced!r}")
    if not onednn_available:
        return "aten"
    if forced in BACKENDS:
        return forced
    return "onednn" if vendor in ONEDNN_VENDORS and avx512 else "aten"


@lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN and its linear (``onednn_linear``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@lru_cache(maxsize=None)
def onednn_bf16_available() -> bool:
    """Whether oneDNN's linear takes bf16 on this CPU: it needs AVX-512 (or AMX) for bf16, and elsewhere
    (an AVX2-only CPU) fails to create its kernel ("could not create a primitive descriptor"), where F.linear
    runs bf16 through PyTorch's own code."""
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_available() and is_supported is not None and bool(is_supported())


@lru_cache(maxsize=None)
def backend() -> str:
    """'onednn' or 'aten': the library this machine's fp32 products take (see the module docstring)."""
    try:
        cpuinfo = CPUINFO.read_text()
    except OSError:
        cpuinfo = ""
    return choose_backend(cpu_vendor(cpuinfo), os.environ.get(BACKEND_ENV), onednn_available(),
                          cpu_has_avx512(cpuinfo))


def _fp32_on_cpu(x: Tensor, weight: Tensor) -> bool:
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
            and x.layout == weight.layout == torch.strided and x.numel() > 0
            and not torch.is_autocast_enabled("cpu"))  # autocast would run F.linear in bf16: leave it that


def _takes_onednn(x: Tensor, weight: Tensor) -> bool:
    return _fp32_on_cpu(x, weight) and backend() == "onednn"


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x·weightᵀ + bias through oneDNN's linear, the bias added inside its kernel (``onednn_available`` first);
    weight (out, in), x (..., in) -> (..., out). Any dtype oneDNN multiplies (fp32 here; a bf16 base product with
    a bias in ``minituner.lora_product``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """y = x·Wᵀ + b and each gradient autograd asks for, through backend()'s library (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x_needs, w_needs = x.requires_grad, weight.requires_grad
        # what autograd keeps for F.linear: x for the weight's gradient, W for x's (references: no new memory)
        ctx.save_for_backward(x if w_needs else None, weight if x_needs else None)
        return product(x, weight, bias)  # (..., out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = input_grad(grad_y, weight)  # (..., in)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g = grad_y.reshape(-1, grad_y.shape[-1])  # (N, out)
            if ctx.needs_input_grad[1]:
                grad_w = weight_grad(g, x.reshape(-1, x.shape[-1]))  # (out, N)·(N, in) -> (out, in)
            if ctx.needs_input_grad[2]:
                grad_b = g.sum(0)  # (out,)
        return grad_x, grad_w, grad_b


def input_grad(grad_y: Tensor, weight: Tensor) -> Tensor:
    """grad_y·W, the gradient of x·Wᵀ for x: (..., out) -> (..., in)."""
    if not _takes_onednn(grad_y, weight):
        return grad_y @ weight
    return onednn_linear(grad_y, weight.t(), None)  # Wᵀ as a view: oneDNN reads (in, out) weights at full speed


def weight_grad(grad_y: Tensor, x: Tensor) -> Tensor:
    """grad_yᵀ·x, the gradient of x·Wᵀ for W: (N, out), (N, in) -> (out, in); torch.mm, no copy (see above)."""
    return grad_y.t() @ x


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x·Wᵀ + b with no autograd of its own (for a caller's autograd Function, e.g. a dequantized weight)."""
    if not _takes_onednn(x, weight):
        return F.linear(x, weight, bias)
    return onednn_linear(x, weight, None if bias is None else bias.to(x.dtype))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, with fp32 CPU products (and their gradients) through oneDNN where backend() chose it, and a
    trainable fp32 weight's gradient made fresh on either library (see the module docstring)."""
    if not _fp32_on_cpu(x, weight):
        return F.linear(x, weight, bias)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if weight.requires_grad or backend() == "onednn":
            return _Linear.apply(x, weight, bias)
        return F.linear(x, weight, bias)
    return product(x, weight, bias)

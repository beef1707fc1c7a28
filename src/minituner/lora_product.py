"""One adapter on a frozen base as one autograd Function: y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, for bf16 compute, and for fp32
where the adapter's thin products run as C (``minituner.native_lora_fp32``).

    if fused_fits(lora, x2, name):                           # one adapter, no dropout, a frozen plain or NF4 base
        y, seen_finite = lora_product(lora, x2, name, scale) # (N, out), what LoRALinear.forward computes; whether
                                                             # the C kernels saw every value of y finite

``LoRALinear.forward`` computes the same as two pieces that autograd joins: the base layer (for an NF4 base
miniquant's ``DequantLinearFunction``) and ``LoRAUpdate``. Joined, the fp32 masters' casts to bf16 are two graph
nodes of their own, and the input's gradient arrives in two halves (the base's g·W and the adapter's s·(g·B)·A)
that autograd adds in one more pass over the (N, in) tensor. Here one Function holds the whole product: forward as
before (the base product, its bias added by oneDNN inside the GEMM on a CPU whose oneDNN takes bf16, then the
adapter added into its output in place), backward with the adapter's share added into g·W by the same GEMM
(``addmm_``: its (N, r)·(r, in) product is summed in fp32 and rounded once, where the two pieces rounded it to bf16
first and then rounded the sum).
On the bench's GPT-shaped bf16 QLoRA step (benchmarks/bench_bf16.py, 48 such products; AMD EPYC, 2 cores) a
step took 229.9 ms against 235.8 (medians of 25 steps, the two models alternating in one process, 2026-12-03).

Where the CPU has AVX512-BF16 (``minituner.native_lora.fits``: an even rank, fp32 masters) the adapter's thin
products run as C: one call in forward (x·Aᵀ, then the adapter added into y row by row), two in backward (the
masters' gradients, summed in fp32 and handed over unrounded; then the adapter's share added into g·W), each
reading the masters itself. Where an NF4 base's g·W runs as ``miniquant.nf4_matmul``
(``QuantizedLinear.input_grad_adding``) the adapter's share is summed inside that product instead, rounded once with
it: one pass less over (N, in). On a CPU with AMX, an NF4 base that ``miniquant.nf4_amx`` takes (weights of at most
2^20 values) runs both products as a GEMM on the tiles with the adapter's share added inside before the one
rounding: in forward a = x·Aᵀ comes from native_lora's ``down`` and y is written once (``_base_and_adapter``), in
backward through ``input_grad_adding`` as above; a larger one (for inputs of at most 512 rows) likewise as
``miniquant.nf4_brgemm``, the same bits (per product 0.89-1.00x the base's product plus native_lora's pass after,
its module docstring gives them; in the bench's 6-layer Llama-3.2-1B-shaped bf16 QLoRA step 0.99x and 1.01x the
step's time, medians of the per-round ratios of 16 rounds each, the two ways alternating in one process, within
the noise of a slow phase of the machine; Intel Xeon with AMX, 2026-12-06). Through PyTorch the same work
is six thin products, four casts,
two scalings and a copy a layer, each a separate op; the bench's step above took 275.6 ms against 307.4 through
PyTorch (medians of 24 steps, the two models alternating in one process, 2026-12-03).

An MLP's second Linear may be handed GELU's input h instead of its output (``LoRALinear.forward(h, gelu=...)``,
as ``minigpt.model.MLP`` does): the Function then applies GELU itself (``minigpt.native_gelu.gelu_values``, the
values GELU's own Function gives), saves h beside GELU's output, and returns h's gradient: applied inside
``miniquant.nf4_matmul``'s product where that runs the input gradient (no (N, in) gradient stored and read back
for a GELU node of its own), else after it as GELU's backward computes it (``native_gelu.gelu_grad``). The same
bits either way, and the same saved tensors as GELU and the layer apart.

In fp32 the Function is taken only where ``minituner.native_lora_fp32`` runs (a CPU with AVX2 and FMA, or AVX-512):
the same three C calls a layer, the base's products through the library ``minikernels.fp32_gemm`` chose, as the
base's own Function runs them; elsewhere (CUDA, other CPUs) fp32 keeps the two pieces.

It saves what the two pieces save together: x (which LoRAUpdate kept), the bf16 copies of A and B (with the C
kernels the fp32 masters themselves, no copies), a = x·Aᵀ (N, r) and the base's own frozen tensors (an NF4
base's codes and scales, read again in backward for the input's gradient: unpacked inside that product where
``miniquant.nf4_matmul`` runs, else dequantized into miniquant's shared workspace; a frozen Linear's weight), so
``minituner.planner`` counts it as it is (the bf16 copies' r·(in + out) values a layer, none where the C kernels
run; in fp32 the masters are what the two pieces save too). The base layer's own module is not
called: the fused path is taken only where it has no hooks of its own.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from minigpt import native_gelu
from minikernels import fp32_gemm
from minituner import native_lora, native_lora_fp32


def _frozen_weight(base: nn.Module, tensors: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """The base's (out, in) weight in dtype: dequantized from its buffers (into the shared workspace), or a frozen
    Linear's own weight."""
    if isinstance(base, nn.Linear):
        return tensors[0]
    return base.dequantize_from(tensors, dtype, transient=True)


def _base_forward(base: nn.Module, frozen: tuple[Tensor, ...], x: Tensor, bias: Tensor | None) -> Tensor:
    """x·Wᵀ + bias (N, out), the base's product: an NF4 weight's on AMX's tiles where ``QuantizedLinear.amx_product``
    takes it, else W (``_frozen_weight``) through ``base_product``."""
    amx_product = getattr(base, "amx_product", None)
    done = amx_product(frozen, x, bias) if amx_product is not None else None
    return done[0] if done is not None else base_product(x, _frozen_weight(base, frozen, x.dtype), bias)


def _base_and_adapter(native: native_lora.NativeLoRA, base: nn.Module, frozen: tuple[Tensor, ...], x: Tensor,
                      bias: Tensor | None, A: Tensor, B: Tensor, scale: float) -> tuple[Tensor, Tensor, bool]:
    """(y, a, finite) with the C kernels: y = x·Wᵀ + bias + scale·a·Bᵀ (N, out), a = x·Aᵀ (N, r), finite: every
    value of y seen finite as it was written. An NF4 base on AMX's tiles adds the adapter inside its GEMM, before
    the one rounding (``QuantizedLinear.amx_product``; a from ``native_lora``'s down); elsewhere the base's product,
    then native_lora's forward_ adds it in place."""
    amx_fits = getattr(base, "amx_fits", None)
    if native is native_lora.kernels() and amx_fits is not None and amx_fits(frozen, x, bias, A.shape[0]):
        a = native.down(x, A)  # (N, r)
        done = base.amx_product(frozen, x, bias, (a, B, scale), checked=True)  # (amx_fits just asked)
        if done is not None:
            return done[0], a, done[1]
    y = _base_forward(base, frozen, x, bias)
    a, finite = native.forward_(y, x, A, B, scale)  # (N, r); y += scale·a·Bᵀ in place
    return y, a, finite


def _frozen_tensors(base: nn.Module) -> tuple[Tensor, ...]:
    """What the base's weight is made from (saved for backward, so an in-place change there raises)."""
    return (base.weight,) if isinstance(base, nn.Linear) else tuple(base.quantized_tensors())


def _base_input_grad(base: nn.Module, frozen: tuple[Tensor, ...], g: Tensor) -> Tensor:
    """g·W (N, in), the base's share of the input's gradient: a frozen Linear's weight, or a quantized one's from
    its buffers (``QuantizedLinear.input_grad_from``: NF4 unpacked inside the product where ``miniquant.nf4_matmul``
    runs, else dequantized into the shared workspace)."""
    if isinstance(base, nn.Linear):
        return fp32_gemm.input_grad(g, frozen[0])
    return base.input_grad_from(frozen, g)


def base_product(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x·wᵀ + bias. bf16 on CPU through oneDNN's linear, which adds the bias inside its kernel: F.linear's addmm
    first copies the bias into every row of the output, one more pass over (N, out). The same bits (tested).
    Where oneDNN takes no bf16 (an AVX2-only CPU: ``fp32_gemm.onednn_bf16_available``), F.linear. fp32 through
    the library ``fp32_gemm`` chose for this CPU, as a frozen base's own product (``DequantLinearFunction``)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and bias is not None and fp32_gemm.onednn_bf16_available():
        return fp32_gemm.onednn_linear(x, w, bias)
    return fp32_gemm.product(x, w, bias)


def native_kernels(x: Tensor, A: Tensor, B: Tensor) -> native_lora.NativeLoRA | None:
    """The C kernels that run the adapter's thin products on x: bf16 (``native_lora``) or fp32
    (``native_lora_fp32``); None: PyTorch's ops."""
    if native_lora.fits(x, A, B):
        return native_lora.kernels()
    return native_lora_fp32.kernels() if native_lora_fp32.fits(x, A, B) else None


def _fp32_fits(lora: nn.Module, x2: Tensor, name: str) -> bool:
    """fp32 compute where ``native_lora_fp32`` runs: a frozen fp32 Linear base, or a quantized one computing in
    fp32. (Elsewhere fp32 takes LoRALinear's two pieces: the fused Function gains only from the C kernels.)"""
    base = lora.base_layer
    if x2.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):  # (autocast would make the base's y bf16)
        return False
    if not native_lora_fp32.fits(x2, lora.lora_A[name].weight, lora.lora_B[name].weight):
        return False
    if isinstance(base, nn.Linear):
        return base.weight.dtype == torch.float32
    return getattr(base, "compute_dtype", None) in (None, torch.float32) and hasattr(base, "quantized_tensors")


def fused_fits(lora: nn.Module, x2: Tensor, name: str) -> bool:
    """Whether lora_product computes this call: `name` the one active adapter without dropout in play, a base with
    no hooks of its own, and either a low-precision compute dtype that x2 (N, in) already has with a base that is
    a frozen Linear stored in that dtype or a quantized linear computing in it (``quantized_tensors``,
    ``dequantize_from``), or fp32 where the fp32 C kernels run (``_fp32_fits``). With grad off (no_grad, inference
    mode) a Linear base whose weight would train counts as frozen: no gradient is taken."""
    cd, base = lora.compute_dtype, lora.base_layer
    if x2.dim() != 2 or len(lora.active_adapters) != 1:
        return False
    dropout = lora.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and dropout.training:
        return False
    if base._forward_hooks or base._forward_pre_hooks:
        return False
    if isinstance(base, nn.Linear) and torch.is_grad_enabled() and (
            base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
        return False  # a base that trains
    if cd is None or cd == torch.float32:
        return _fp32_fits(lora, x2, name)
    if x2.dtype != cd:
        return False
    if isinstance(base, nn.Linear):
        return base.weight.dtype == cd
    return getattr(base, "compute_dtype", None) == cd and hasattr(base, "quantized_tensors")


class LoRAProduct(torch.autograd.Function):
    """y = x·Wᵀ + b + scale·(x·Aᵀ)·Bᵀ, W frozen; gradients for x, A and B (see the module docstring). With gelu
    (F.gelu's approximate) the input is GELU's: x = gelu(h), and the gradient is h's."""

    @staticmethod
    def forward(ctx, x: Tensor, A: Tensor, B: Tensor, bias: Tensor | None, base: nn.Module, scale: float,
                seen_finite: list, gelu: str | None, *frozen: Tensor) -> Tensor:
        h = None
        if gelu is not None:  # x is GELU's input h: the product reads gelu(h), as minigpt.native_gelu.gelu computes it
            h, x = x, native_gelu.gelu_values(x, gelu)
            h = h if ctx.needs_input_grad[0] else None  # (kept, as GELU keeps it, only for h's gradient)
        bias = None if bias is None else bias.to(x.dtype)
        ctx.native = native_kernels(x, A, B)  # (backward uses the same)
        if ctx.native is not None:  # the adapter's thin products in C, from the fp32 masters (native_lora*)
            y, a, finite = _base_and_adapter(ctx.native, base, frozen, x, bias, A, B, scale)
            seen_finite.append(finite)  # (every value of y looked at as it was written)
            ctx.save_for_backward(x, A, B, a, h, *frozen)
        else:
            y = _base_forward(base, frozen, x, bias)  # (N, out)
            a_low, b_low = A.to(x.dtype), B.to(x.dtype)  # (r, in), (out, r): the masters computed in x's dtype
            a = x @ a_low.t()  # (N, r)
            y.addmm_(a, b_low.t(), alpha=scale)  # (N, out): the adapter added in place
            ctx.save_for_backward(x, a_low, b_low, a, h, *frozen)
        ctx.base, ctx.scale, ctx.master_dtypes, ctx.gelu = base, scale, (A.dtype, B.dtype), gelu
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):  # g (N, out)
        x, a_low, b_low, a, h, *frozen = ctx.saved_tensors  # (native: the fp32 masters A and B)
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        g = g.to(x.dtype)
        if ctx.native is not None:
            return _backward_native(ctx, g.contiguous(), x, a_low, b_low, a, h, frozen)
        grad_x = grad_A = grad_B = None
        grad_a_t = (b_low.t().contiguous() @ g.t()).mul_(ctx.scale) if need_x or need_A else None  # (r, N)
        if need_A:
            grad_A = (grad_a_t @ x).to(ctx.master_dtypes[0])  # (r, in)
        if need_B:
            grad_B = (a.t() @ g).mul_(ctx.scale).t().to(ctx.master_dtypes[1])  # (r, out) -> (out, r)
        if need_x:
            grad_x = _base_input_grad(ctx.base, tuple(frozen), g)  # (N, in): the base's
            grad_x.addmm_(grad_a_t.t(), a_low)  # plus the adapter's, in the same pass
            if ctx.gelu is not None:
                grad_x = native_gelu.gelu_grad(grad_x, h, ctx.gelu)  # h's, as GELU's own backward gives it
        return (grad_x, grad_A, grad_B) + (None,) * (5 + len(frozen))


def _backward_native(ctx, g: Tensor, x: Tensor, A: Tensor, B: Tensor, a: Tensor, h: Tensor | None,
                     frozen: list[Tensor]):
    """LoRAProduct.backward with the adapter's thin products in C: the masters' gradients summed in fp32 and handed
    over unrounded, the adapter's share of the input's gradient added into g·W in place (and GELU's gradient
    applied in the same product where miniquant.nf4_matmul takes it)."""
    need_x, need_A, need_B = ctx.needs_input_grad[:3]
    grad_a, grad_A, grad_B = ctx.native.backward(g, x, a, B, ctx.scale, need_x, need_A, need_B)
    grad_x, frozen = None, tuple(frozen)
    adding = getattr(ctx.base, "input_grad_adding", None) if need_x else None  # (an NF4 base: QuantizedLinear's)
    if adding is not None:  # g·W + grad_a·A in one product, rounded once (then times GELU's slope); None: cannot
        grad_x = adding(frozen, g, grad_a, A, None if h is None else (h, ctx.gelu))
    if need_x and grad_x is None:
        grad_x = _base_input_grad(ctx.base, frozen, g)  # (N, in): the base's
        ctx.native.input_update_(grad_x, grad_a, A)  # plus the adapter's (bf16: rounded again)
        if ctx.gelu is not None:
            grad_x = native_gelu.gelu_grad(grad_x, h, ctx.gelu)  # h's, as GELU's own backward gives it
    return (grad_x, grad_A, grad_B) + (None,) * (5 + len(frozen))


def lora_product(lora: nn.Module, x2: Tensor, name: str, scale: float,
                 gelu: str | None = None) -> tuple[Tensor, bool]:
    """(y, seen_finite): the base and adapter `name` of a LoRALinear on x2 (N, in) as one Function (``fused_fits``
    first); seen_finite: the C kernels found every value of y finite as they wrote it (False: not looked at, or not
    all finite). With gelu (F.gelu's approximate: "none", "tanh") x2 is GELU's input and the layer reads its output:
    the layer on gelu(x2), the gradient x2's (GELU's fused into the input gradient's product where it can be)."""
    base, seen = lora.base_layer, []
    y = LoRAProduct.apply(x2, lora.lora_A[name].weight, lora.lora_B[name].weight, base.bias, base, scale, seen,
                          gelu, *_frozen_tensors(base))
    return y, bool(seen) and seen[0]

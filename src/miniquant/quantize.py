"""QuantizedLinear: a Linear whose weight is stored quantized (int8 / int4 per group, or NF4).

Schemes (the name says codes and group size):
    int8_per_group_<G>   symmetric int8, one float32 scale per G input features of each row
    int4_per_group_<G>   symmetric int4 (two codes per byte), one float32 scale per G input features
    nf4_per_group_<G>    NF4 in flattened blocks of G values, byte-identical to bitsandbytes
                         (G in 32, 64, ..., 4096 as bitsandbytes allows; QLoRA uses 64)

The quantized weight lives in buffers, never parameters, so optimizers and `requires_grad` never see
it; the bias (if any) is a frozen float buffer. Buffer names (they are the state_dict keys):
    int8: weight_q (out, in) int8,              weight_scale (out, ceil(in/G)) float32
    int4: weight_packed (ceil(out*in/2),) uint8, weight_scale (out, ceil(in/G)) float32
    nf4:  weight_packed (ceil(out*in/2),) uint8, weight_absmax (ceil(out*in/G),) float32
    bias: (out,) in the original Linear's dtype, absent when the Linear had none
The scheme and the original weight dtype are constructor arguments, not state: build the module with
`QuantizedLinear(in, out, scheme, bias=..., weight_dtype=...)` and `load_state_dict` into it.

forward(x) dequantizes the weight to x's dtype, computes x @ W^T + b (fp32 on CPU through
minikernels.fp32_gemm: oneDNN on AMD CPUs) and drops W. Its backward
dequantizes W again to return the gradient for x only: nothing dequantized is kept for backward
(only the quantized buffers are saved, which costs no memory and catches in-place changes).
NF4 weights are dequantized into a workspace reused by every layer (one buffer per thread, device and
dtype, as large as the largest layer): no allocation and no page faults per call. On a CPU with AMX, bf16
products of NF4 weights are computed without it where they fit: weights of at most 2^20 values are written into
it in AMX's tile layout for miniquant.nf4_amx's GEMM, larger ones unpacked panel by panel inside
miniquant.nf4_brgemm's product (inputs of at most 512 rows). With
`compute_dtype` set (e.g. torch.bfloat16), forward casts x to it, computes in it and returns x's dtype.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minikernels import fp32_gemm

from . import native, nf4_amx, nf4_brgemm, nf4_matmul
from .errors import QuantizationError
from .int_quant import IntQuantized, dequantize_symmetric_per_group, quantize_symmetric_per_group
from .nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

DEFAULT_QUANT_SCHEME = "nf4_per_group_64"  # QLoRA's NF4 in blocks of 64, bitsandbytes-identical
NF4_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the block sizes bitsandbytes accepts
VALID_SCHEMES = (
    "int8_per_group_<G>, int4_per_group_<G> (G a positive integer), nf4_per_group_<G> (G in 32, 64, ..., 4096)"
)
_SCHEME_RE = re.compile(r"(int8|int4|nf4)_per_group_([1-9][0-9]*)")


@dataclass(frozen=True)
class QuantScheme:
    kind: str  # "int8", "int4" or "nf4"
    group_size: int  # values per scale (per block for nf4)

    @property
    def name(self) -> str:
        return f"{self.kind}_per_group_{self.group_size}"


def parse_scheme(name: str) -> QuantScheme:
    """'int4_per_group_32' -> QuantScheme('int4', 32); anything else raises QuantizationError listing valid ones."""
    m = _SCHEME_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None or (m.group(1) == "nf4" and int(m.group(2)) not in NF4_BLOCKSIZES):
        raise QuantizationError(f"unknown quantization scheme {name!r}; valid: {VALID_SCHEMES}")
    return QuantScheme(m.group(1), int(m.group(2)))


def _buffer_shapes(scheme: QuantScheme, out_features: int, in_features: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """Name -> (shape, dtype) of the quantized weight buffers, in the order dequantize_from takes them."""
    n, g = out_features * in_features, scheme.group_size
    scale = ((out_features, -(-in_features // g)), torch.float32)
    if scheme.kind == "int8":
        return {"weight_q": ((out_features, in_features), torch.int8), "weight_scale": scale}
    if scheme.kind == "int4":
        return {"weight_packed": ((-(-n // 2),), torch.uint8), "weight_scale": scale}
    return {"weight_packed": ((-(-n // 2),), torch.uint8), "weight_absmax": ((-(-n // g),), torch.float32)}


def _nf4_surely_finite(absmax: Tensor, dtype: torch.dtype) -> bool:
    """True when every NF4 value code x absmax is finite in dtype: |code| <= 1, so finite scales no larger
    than dtype's largest value are enough. False means "look at the values" (it does not mean non-finite)."""
    kernels = native.kernels() if absmax.is_cpu and absmax.dtype == torch.float32 else None
    if kernels is not None and absmax.is_contiguous():  # one C call: no ops, no tensors made, no .item()
        return kernels.scales_within(absmax, _largest_product(dtype))
    low, high = (float(v) for v in torch.aminmax(absmax))  # one pass, nothing allocated; NaN if any is NaN
    return math.isfinite(low) and math.isfinite(high) and max(-low, high) <= torch.finfo(dtype).max


def _nf4_buffers_fit(qtensors: tuple[Tensor, ...], dtype: torch.dtype) -> bool:
    """Whether an NF4 weight's buffers go to the kernels that unpack it inside their products as they are: the codes
    and fp32 scales contiguous, and scales that keep every value finite in `dtype` (what dequantize_from checks)."""
    return (qtensors[0].is_contiguous() and qtensors[1].dtype == torch.float32 and qtensors[1].is_contiguous()
            and _nf4_surely_finite(qtensors[1], dtype))


@lru_cache(maxsize=None)
def _largest_product(dtype: torch.dtype) -> float:
    """The largest scale whose products with the NF4 codes are finite in dtype: code x scale is an fp32 product
    before its cast (so an fp64 weight is finite where the fp32 product is)."""
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)


class _Workspace(threading.local):
    """Per-thread scratch buffers for transient dequantized weights, one per (device, dtype), grown to fit.

    A dequantized weight lives only between its dequantization and the matrix product that reads it (in
    DequantLinearFunction's forward and backward), so all layers can share one buffer. Per thread: a thread
    running another model's forward or backward gets its own. On CUDA the product is queued on the same
    stream as the next dequantization, so the stream orders the reuse."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous (numel,) tensor of `dtype` on `device`; its contents are undefined."""
        key = (device, dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor even when first needed under inference_mode, so
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)  # it is written after it too
        return buf[:numel]


_workspace = _Workspace()


def workspace_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """This thread's shared scratch buffer of `numel` values: its contents are undefined and valid only until the
    next transient weight on this thread (for a weight used by one product at once, as DequantLinearFunction's)."""
    return _workspace.get(numel, dtype, device)


def workspace_bytes() -> int:
    """Bytes held by this thread's dequantization workspace (all devices and dtypes)."""
    return sum(b.numel() * b.element_size() for b in _workspace.buffers.values())


def release_workspace() -> None:
    """Free this thread's dequantization workspace (it is allocated again on the next use)."""
    _workspace.buffers.clear()


class DequantLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with W dequantized on the fly in forward and again in backward (the layer's input_grad_from:
    an NF4 weight with bf16 gradients on a CPU with AVX512-BF16 and no AMX unpacked inside the product,
    ``nf4_matmul``); grad
    for x only. `layer` offers dequantize_from and input_grad_from (QuantizedLinear, minituner's UpcastLinear)."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, layer: "QuantizedLinear", *qtensors: Tensor) -> Tensor:
        ctx.layer, ctx.dtype = layer, x.dtype
        ctx.save_for_backward(*qtensors)  # the quantized buffers only: no extra memory
        bias = None if bias is None else bias.to(x.dtype)
        done = layer.amx_product(qtensors, x, bias) if hasattr(layer, "amx_product") else None  # (AMX's tiles)
        if done is not None:
            return done[0]
        w = layer.dequantize_from(qtensors, x.dtype, transient=True)  # (out, in), in the shared workspace
        return fp32_gemm.product(x, w, bias)  # (N, in) -> (N, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        qtensors = ctx.saved_tensors  # raises if a buffer was modified in place since forward
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.layer.input_grad_from(qtensors, grad_out, ctx.dtype)  # (N, out) @ (out, in) -> (N, in)
        return (grad_x, None, None) + (None,) * len(qtensors)


class QuantizedLinear(nn.Module):
    """A frozen Linear with a quantized weight (see the module docstring for schemes and buffers)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: str,
        bias: bool = True,
        weight_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._scheme = parse_scheme(scheme)
        self.scheme = self._scheme.name
        self.weight_dtype = weight_dtype  # dtype of the original weight; default for dequantize()
        self.compute_dtype: torch.dtype | None = None  # None: compute in the input's dtype
        buffers = _buffer_shapes(self._scheme, out_features, in_features)
        for name, (shape, dtype) in buffers.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        self._buffer_names = tuple(buffers)  # in the order dequantize_from takes them
        self.register_buffer("bias", torch.zeros(out_features, dtype=weight_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str) -> "QuantizedLinear":
        """Quantize an nn.Linear's weight (the Linear itself is left unchanged)."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, scheme, linear.bias is not None, w.dtype, w.device)
        layer.quantize_weight_(w)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def quantize_weight_(self, weight: Tensor) -> None:
        """Quantize a float (out, in) weight into this layer's buffers."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            expected = (self.out_features, self.in_features)
            raise QuantizationError(f"weight of shape {tuple(weight.shape)} does not fit {expected}")
        s = self._scheme
        if s.kind == "nf4":
            q = quantize_nf4(weight, blocksize=s.group_size)
            self.weight_packed.copy_(q.packed)
            self.weight_absmax.copy_(q.absmax)
        else:
            q = quantize_symmetric_per_group(weight, 8 if s.kind == "int8" else 4, s.group_size)
            getattr(self, "weight_q" if s.kind == "int8" else "weight_packed").copy_(q.qweight)
            self.weight_scale.copy_(q.scales)

    def quantized_tensors(self) -> tuple[Tensor, ...]:
        """The quantized weight buffers, in the order `dequantize_from` takes them."""
        buffers = self._buffers
        return tuple(buffers[name] for name in self._buffer_names)

    def dequantize_from(self, qtensors: tuple[Tensor, ...], dtype: torch.dtype, transient: bool = False) -> Tensor:
        """(out, in) weight from the given quantized buffers; raises if the result is not finite.

        transient=True: NF4 is written into the shared workspace, valid only until the next transient
        dequantization on this thread (for a product computed at once, as DequantLinearFunction does). With more
        than one thread the workspace is written with non-temporal stores: the last product read it on every
        thread, and a normal store would first take each line from the other cores' caches (``native``'s
        dequantize). On the bench's GPT-shaped bf16 QLoRA step (benchmarks/bench_bf16.py, 96 such writes; AMD
        EPYC, 2 cores, 2026-12-05; medians of blocks of 16-30 pairs of steps, the two alternating in one process)
        the gain followed the machine's pace, which changed from minute to minute: in every block where a step
        took about 200 ms or more, streaming saved 2.4-8.1 ms a step; where it took 179-198 ms, it ranged from
        1.2 ms saved to 1.7 ms lost (one block: 4.5 ms lost). The fp32 step: 429.2 against 437.8 ms. On one
        thread the bf16 step took 321.7 against 317.7 ms, so there it writes normally."""
        s, shape = self._scheme, torch.Size((self.out_features, self.in_features))
        if s.kind == "nf4":
            out = workspace_buffer(shape.numel(), dtype, qtensors[0].device) if transient else None
            w = dequantize_nf4(NF4Tensor(qtensors[0], qtensors[1], shape, self.weight_dtype, s.group_size), dtype, out,
                               stream=transient and torch.get_num_threads() > 1)
            if _nf4_surely_finite(qtensors[1], dtype):  # one look at the scales (out·in/64) instead of a pass over w
                return w
        else:
            bits = 8 if s.kind == "int8" else 4
            q = IntQuantized(qtensors[0], qtensors[1], shape, self.weight_dtype, bits, s.group_size)
            w = dequantize_symmetric_per_group(q, dtype)
        if not torch.isfinite(w).all():
            raise QuantizationError(
                f"dequantized {self.scheme} weight has NaN/Inf values (corrupt buffers or {dtype} overflow)"
            )
        return w

    def _nf4_input_grad_fits(self, qtensors: tuple[Tensor, ...], g: Tensor) -> bool:
        """Whether ``miniquant.nf4_matmul`` computes g (N, out)·W for this NF4 weight: the kernel built, the shapes
        fitting, g bf16, and scales that keep every value finite in bf16 (what dequantize_from checks)."""
        s = self._scheme
        return (s.kind == "nf4" and nf4_matmul.fits(g, self.in_features, self.out_features, s.group_size)
                and _nf4_buffers_fit(qtensors, g.dtype))

    def _amx_fits(self, qtensors: tuple[Tensor, ...], a: Tensor) -> bool:
        """Whether ``nf4_amx`` multiplies `a` (x·Wᵀ or g·W) by this NF4 weight on AMX's tiles: the CPU has them, the
        shapes fit, the buffers are contiguous fp32 scales, and scales that keep every value finite in bf16."""
        s = self._scheme
        return (s.kind == "nf4" and nf4_amx.fits(a, self.in_features, self.out_features, s.group_size)
                and _nf4_buffers_fit(qtensors, a.dtype))

    def _brgemm_fits(self, qtensors: tuple[Tensor, ...], a: Tensor, bias: Tensor | None = None) -> bool:
        """Whether ``nf4_brgemm`` multiplies `a` (x·Wᵀ + bias or g·W) by this NF4 weight (a large one, on a CPU with
        AMX): the shapes fit, the buffers are contiguous fp32 scales, scales that keep every value finite in bf16,
        and a bias (if any) of a's dtype, contiguous."""
        s = self._scheme
        return (s.kind == "nf4" and nf4_brgemm.fits(a, self.in_features, self.out_features, s.group_size)
                and _nf4_buffers_fit(qtensors, a.dtype)
                and (bias is None or (bias.dtype == a.dtype and bias.is_contiguous())))

    def _brgemm_product(self, qtensors: tuple[Tensor, ...], a: Tensor, transposed: bool, bias: Tensor | None = None,
                        adapter: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, bool]:
        """(c, finite): ``nf4_brgemm``'s product of a with this NF4 weight, as the caller checked it fits:
        a·Wᵀ + bias (transposed, the forward) or a·W (the input's gradient), W unpacked panel by panel inside, an
        adapter's share added before the one rounding where given."""
        return nf4_brgemm.kernels().product(a, qtensors[0], qtensors[1], self._scheme.group_size,
                                            (self.out_features, self.in_features), bias, transposed, adapter=adapter)

    def amx_fits(self, qtensors: tuple[Tensor, ...], x: Tensor, bias: Tensor | None, rank: int = 0) -> bool:
        """Whether ``amx_product`` takes x (N, in) and this bias: ``_amx_fits`` or, for a larger weight,
        ``_brgemm_fits`` for the forward, a bias (if any) of x's dtype, contiguous, and an adapter of this rank (0:
        none) that their GEMMs add (``nf4_amx.MAX_RANK``). Both need AMX, asked first: where it is absent (asked on
        every product's forward) that is the whole answer."""
        return (nf4_amx.usable() and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
                and rank % 2 == 0 and rank <= nf4_amx.MAX_RANK
                and (self._amx_fits(qtensors, x) or self._brgemm_fits(qtensors, x, bias)))

    def amx_product(self, qtensors: tuple[Tensor, ...], x: Tensor, bias: Tensor | None,
                    adapter: tuple[Tensor, Tensor, float] | None = None,
                    checked: bool = False) -> tuple[Tensor, bool] | None:
        """(y, finite): y = x (N, in)·Wᵀ + bias (N, out) from the given buffers on AMX's tiles, where ``amx_fits``:
        by ``nf4_amx`` (W dequantized into the shared workspace in the tiles' layout) or, for a larger weight, by
        ``nf4_brgemm`` (W unpacked panel by panel inside); with adapter = (a, B, scale) (a = x·Aᵀ (N, r) bf16,
        B (out, r) its fp32 master, ``nf4_amx.adapter_fits``), plus scale·a·Bᵀ before the one rounding; finite:
        every value of y written finite. None elsewhere: the caller dequantizes and multiplies its own way (and
        adds the adapter after). checked: the caller has just asked ``amx_fits`` for x and bias (as the adapter's
        forward does before computing a), so it is not asked again."""
        if not checked and not self.amx_fits(qtensors, x, bias):
            return None
        if adapter is not None and not nf4_amx.adapter_fits(x, adapter[0], adapter[1], self.out_features, True):
            return None
        if nf4_brgemm.weight_fits(self.in_features, self.out_features, self._scheme.group_size):
            return self._brgemm_product(qtensors, x, True, bias, adapter)
        return self._amx_product(qtensors, x, True, bias, adapter)

    def _amx_product(self, qtensors: tuple[Tensor, ...], a: Tensor, transposed: bool, bias: Tensor | None = None,
                     adapter: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, bool]:
        """(c, finite): ``nf4_amx``'s product of a with this NF4 weight, as the caller checked it fits: a·Wᵀ + bias
        (transposed, the forward) or a·W (the input's gradient), W written into the shared workspace in the tiles'
        layout, an adapter's share added before the one rounding where given."""
        out = workspace_buffer(self.out_features * self.in_features, a.dtype, a.device)
        return nf4_amx.kernels().product(a, qtensors[0], qtensors[1], self._scheme.group_size,
                                         (self.out_features, self.in_features), out, bias=bias, transposed=transposed,
                                         adapter=adapter)

    def _nf4_matmul_input_grad(self, qtensors: tuple[Tensor, ...], g: Tensor,
                               adapter: tuple[Tensor, Tensor] | None = None,
                               gelu: tuple[Tensor, str] | None = None) -> Tensor:
        """g·W (plus grad_a·A where adapter = (grad_a, A); times GELU's slope where gelu) by ``nf4_matmul``, as the
        caller checked it fits: the codes unpacked inside the product."""
        return nf4_matmul.kernels().input_grad(g, qtensors[0], qtensors[1], self._scheme.group_size, self.in_features,
                                               adapter, gelu)

    def applies_gelu_grad(self, dtype: torch.dtype) -> bool:
        """Whether input_grad_adding applies GELU's gradient inside its product for gradients of `dtype` (asked in
        forward, before there is a gradient): bf16, an NF4 weight of a shape ``nf4_matmul`` takes, its kernel chosen."""
        s = self._scheme
        return (dtype == torch.bfloat16 and s.kind == "nf4" and nf4_matmul.chosen()
                and nf4_matmul.shape_fits(self.in_features, self.out_features, s.group_size))

    def input_grad_from(self, qtensors: tuple[Tensor, ...], g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """g (N, out)·W -> (N, in), the gradient of x·Wᵀ for x, W from the given quantized buffers in `dtype` (default
        g's), no autograd: NF4 with bf16 g on a CPU with AVX512-BF16 and no AMX by ``nf4_matmul`` (the codes unpacked
        inside the product), on a CPU with AMX by ``nf4_amx`` or, for a larger weight, ``nf4_brgemm``, where they
        fit, else W dequantized into the shared workspace and multiplied by ``fp32_gemm.input_grad``."""
        dtype = dtype or g.dtype
        if dtype == g.dtype and self._nf4_input_grad_fits(qtensors, g):
            return self._nf4_matmul_input_grad(qtensors, g)
        if dtype == g.dtype and self._amx_fits(qtensors, g):
            return self._amx_product(qtensors, g, False)[0]
        if dtype == g.dtype and self._brgemm_fits(qtensors, g):
            return self._brgemm_product(qtensors, g, False)[0]
        return fp32_gemm.input_grad(g, self.dequantize_from(qtensors, dtype, transient=True))

    def input_grad_adding(self, qtensors: tuple[Tensor, ...], g: Tensor, grad_a: Tensor, A: Tensor,
                          gelu: tuple[Tensor, str] | None = None) -> Tensor | None:
        """g·W + grad_a·A (N, in) in one product, a LoRA adapter's share (grad_a (N, r), A (r, in) its fp32 master)
        summed inside ``nf4_matmul``'s sums and rounded once with them, where that kernel takes g and the adapter
        (``nf4_matmul.adapter_fits``), or, on a CPU with AMX, summed apart on its tiles and added before the one
        rounding (``nf4_amx``, or ``nf4_brgemm`` for a larger weight, where they take g and the adapter, without
        gelu); with gelu = (h, approximate), the
        layer's input GELU's output at h, the gradient for h (GELU's applied to the rounded sum,
        ``nf4_matmul.gelu_fits``). None elsewhere: the caller adds the adapter (and applies GELU's gradient) its own
        way after input_grad_from."""
        nf4_matmul_fits = self._nf4_input_grad_fits(qtensors, g)  # (asked once: it reads the scales each time)
        if gelu is None and not nf4_matmul_fits \
                and nf4_amx.adapter_fits(g, grad_a, A, self.in_features, False):  # on AMX's tiles, rounded once too
            if self._amx_fits(qtensors, g):
                return self._amx_product(qtensors, g, False, adapter=(grad_a, A, 1.0))[0]
            if self._brgemm_fits(qtensors, g):
                return self._brgemm_product(qtensors, g, False, adapter=(grad_a, A, 1.0))[0]
        if not (nf4_matmul_fits and nf4_matmul.adapter_fits(g, grad_a, A, self.in_features)):
            return None
        if gelu is not None and not nf4_matmul.gelu_fits(g, *gelu):
            return None
        return self._nf4_matmul_input_grad(qtensors, g, (grad_a, A), gelu)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The (out, in) weight in `dtype` (default: the original weight's dtype); a new tensor, no grad."""
        with torch.no_grad():
            return self.dequantize_from(self.quantized_tensors(), dtype or self.weight_dtype)

    def storage_bytes(self) -> int:
        """Exact bytes of the quantized weight buffers (codes and scales; the bias is not counted)."""
        return sum(t.numel() * t.element_size() for t in self.quantized_tensors())

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise QuantizationError(
                f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}"
            )
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            return self._forward(x.to(self.compute_dtype)).to(x.dtype)  # compute in compute_dtype, return x's
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        # the Function sees 2-D tensors, so its output is not a view (callers such as LoRA may add into it in place)
        if x.dim() == 2:  # (N, in): no reshape, no view node in the graph
            return DequantLinearFunction.apply(x, self.bias, self, *self.quantized_tensors())  # (N, out)
        y = DequantLinearFunction.apply(x.reshape(-1, self.in_features), self.bias, self, *self.quantized_tensors())
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme}, bias={self.bias is not None}"
            + ("" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}")
        )

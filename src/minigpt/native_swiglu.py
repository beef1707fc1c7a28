"""SwiGLU's gate for bf16 on CPU, ``act(gate) * up``: one pass of C forward and one backward.

    if fits(gate, up):                          # bf16 on CPU, same shape, contiguous
        h = swiglu(gate, up, "silu")            # act(gate) * up, rounded as PyTorch's two bf16 ops round it

As PyTorch ops, ``F.silu(gate) * up`` is two passes over (tokens × intermediate_size) forward and three
backward (the two products' gradients and silu's), and autograd keeps three tensors: gate, act(gate) and up.
Here, with silu (the activation of the llama, mistral and qwen2 checkpoints), each direction is one pass of C,
and the Function keeps gate (when either input needs a gradient) and up (when gate does); act(gate) is
recomputed in the backward. ``minituner.planner`` counts those two terms under bf16 compute on CPU.

What silu computes, per value in fp32: s = bf16(g·σ(g)), σ(g) = 1 / (1 + e^-g) (from e^-|g|, so the exp never
overflows), h = bf16(s · u), as ``F.silu(g) * u`` rounds it in bf16. Backward: du = bf16(dh · s),
dg = bf16(bf16(dh · u) · σ(g)·(1 + g·(1 - σ(g)))), silu's gradient as PyTorch writes it. σ comes from a short
exp (a degree-5 polynomial with fused multiply-adds, about 2e-6 relative; a bf16 unit is 4e-3) and a refined
reciprocal, so σ(g) is within a few fp32 units of PyTorch's; after rounding to bf16 about 0.2% of values land
one unit away (two, where a rounded silu(g) then multiplies). Roundings are PyTorch's (nearest even, denormals
kept, NaN as 0x7FC0); on CPUs with AVX-512 bf16 instructions a stored value is rounded by ``vcvtneps2bf16``,
except in a group of 16 holding a NaN or a denormal, which that instruction would write otherwise.
NaN and ±inf give PyTorch's results. The C loops read their inputs ahead in software
(``minikernels.stream_prefetch``: at 512 × 8,192 the forward 2.0-2.3 → 1.6 ms, the backward 2.7-2.8 → 2.5 ms,
2 threads, 2026-12-06). Another activation (GELU's) runs as PyTorch ops inside the same Function,
keeping the same two tensors. Used only where the C was built with AVX-512 (``swiglu_vectorized``); elsewhere,
and for fp32, fp16 and CUDA, the decoder runs ``act(gate) * up`` as PyTorch ops.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C, BF16_SIGMOID_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, parallel_entry
from minikernels.stream_prefetch import STREAM_PREFETCH_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]
MIN_VALUES_PER_THREAD = 1 << 16  # fewer values stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 17  # threads take values in chunks of this many

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + BF16_SIGMOID_C + STREAM_PREFETCH_C + r"""
int swiglu_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* 16 values: h = bf16(bf16(g·σ(g)) · u) */
static inline void swiglu_forward16(const uint16_t* g, const uint16_t* u, uint16_t* h) {
    __m512 x = load16(g);
    __m512 s = round16(_mm512_mul_ps(x, sigmoid16(x)));
    store16(h, _mm512_mul_ps(s, load16(u)));
}

/* 16 values: du = bf16(dh · s) (du may be NULL), dg = bf16(bf16(dh · u) · σ·(1 + g·(1 - σ))) (dg may be NULL) */
static inline void swiglu_backward16(const uint16_t* dh, const uint16_t* g, const uint16_t* u, uint16_t* dg,
                                     uint16_t* du) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 x = load16(g), d = load16(dh);
    __m512 sg = sigmoid16(x);
    if (du) store16(du, _mm512_mul_ps(d, round16(_mm512_mul_ps(x, sg))));
    if (dg) {
        __m512 ds = round16(_mm512_mul_ps(d, load16(u)));
        __m512 slope = _mm512_mul_ps(sg, _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, sg))));
        store16(dg, _mm512_mul_ps(ds, slope));
    }
}
#endif

/* values [i0, i1) by swiglu_forward16; the last n < 16 through the same code in a zero-padded block (TAIL16) */
void swiglu_forward(const uint16_t* g, const uint16_t* u, int64_t i0, int64_t i1, uint16_t* h) {
#ifdef __AVX512F__
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        if ((i & 31) == 0) { prefetch_ahead(g + i); prefetch_ahead(u + i); }  /* once a line (stream_prefetch) */
        swiglu_forward16(g + i, u + i, h + i);
    }
    if (i < i1) {
        TAIL16(i1 - i, g + i, gt);
        TAIL16(i1 - i, u + i, ut);
        uint16_t ht[16];
        swiglu_forward16(gt, ut, ht);
        memcpy(h + i, ht, (size_t)(i1 - i) * 2);
    }
#endif
}

/* values [i0, i1) by swiglu_backward16 (u is read only for dg), the tail as in swiglu_forward */
void swiglu_backward(const uint16_t* dh, const uint16_t* g, const uint16_t* u, int64_t i0, int64_t i1,
                     uint16_t* dg, uint16_t* du) {
#ifdef __AVX512F__
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        if ((i & 31) == 0) {  /* once a line (stream_prefetch) */
            prefetch_ahead(dh + i); prefetch_ahead(g + i);
            if (dg) prefetch_ahead(u + i);
        }
        swiglu_backward16(dh + i, g + i, dg ? u + i : NULL, dg ? dg + i : NULL, du ? du + i : NULL);
    }
    if (i < i1) {
        size_t n = (size_t)(i1 - i) * 2;
        TAIL16(i1 - i, dh + i, dht);
        TAIL16(i1 - i, g + i, gt);
        TAIL16(i1 - i, dg ? u + i : NULL, ut);
        uint16_t dgt[16], dut[16];
        swiglu_backward16(dht, gt, ut, dg ? dgt : NULL, du ? dut : NULL);
        if (dg) memcpy(dg + i, dgt, n);
        if (du) memcpy(du + i, dut, n);
    }
#endif
}

/* the two above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void swiglu_forward_parallel(const uint16_t* g, const uint16_t* u, int64_t b0, int64_t b1, uint16_t* h,
                             int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, i0, i1, swiglu_forward(g, u, i0, i1, h));
}

void swiglu_backward_parallel(const uint16_t* dh, const uint16_t* g, const uint16_t* u, int64_t b0, int64_t b1,
                              uint16_t* dg, uint16_t* du, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, i0, i1, swiglu_backward(dh, g, u, i0, i1, dg, du));
}
"""


class SwiGLUKernels:
    """The compiled kernels, values split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._forward = lib.swiglu_forward
        self._forward.argtypes = [ptr, ptr, i64, i64, ptr]
        self._forward.restype = None
        self._forward_parallel = parallel_entry(lib, self._forward)  # over OpenMP's threads
        self._backward = lib.swiglu_backward
        self._backward.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr]
        self._backward.restype = None
        self._backward_parallel = parallel_entry(lib, self._backward)  # over OpenMP's threads
        self._threads = ThreadSplit("minigpt-swiglu", openmp=bool(lib.mk_openmp()))

    def forward(self, g: Tensor, u: Tensor) -> Tensor:
        """silu(g) * u for contiguous bf16 g, u of one shape."""
        h = torch.empty_like(g)
        args = (g.data_ptr(), u.data_ptr())
        self._threads.run(g.numel(), 1, lambda i0, i1: self._forward(*args, i0, i1, h.data_ptr()),
                          MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda i0, i1, c, t: self._forward_parallel(*args, i0, i1, h.data_ptr(), c, t))
        return h

    def backward(self, dh: Tensor, g: Tensor, u: Tensor | None, need_g: bool, need_u: bool
                 ) -> tuple[Tensor | None, Tensor | None]:
        """(dg, du) for contiguous bf16 dh, g, u (u needed only for dg); None where not asked for."""
        dg = torch.empty_like(g) if need_g else None
        du = torch.empty_like(g) if need_u else None
        args = (dh.data_ptr(), g.data_ptr(), u.data_ptr() if u is not None else None)
        outs = (dg.data_ptr() if dg is not None else None, du.data_ptr() if du is not None else None)
        self._threads.run(g.numel(), 1, lambda i0, i1: self._backward(*args, i0, i1, *outs),
                          MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda i0, i1, c, t: self._backward_parallel(*args, i0, i1, *outs, c, t))
        return dg, du


_FAMILY = KernelFamily("bf16_swiglu", _SOURCE, CFLAGS, "minigpt's native SwiGLU kernels", SwiGLUKernels,
                       LIBS, vectorized="swiglu_vectorized", parallel=True)
_usable = _FAMILY.usable  # None for a library built without AVX-512


def kernels() -> SwiGLUKernels | None:
    """The native SwiGLU kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()


def takes_bf16_run() -> bool:
    """Whether a bf16 CPU training run's SwiGLU runs here (what minituner.planner counts)."""
    return kernels() is not None


def fits(g: Tensor, u: Tensor) -> bool:
    """Whether swiglu takes these: bf16 on CPU, one shape, both contiguous, and the kernels built."""
    return (g.dtype == u.dtype == torch.bfloat16 and g.device.type == u.device.type == "cpu" and g.shape == u.shape
            and g.is_contiguous() and u.is_contiguous() and kernels() is not None)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, act: Callable[[Tensor], Tensor] | None) -> Tensor:
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h = kernels().forward(g, u) if act is None else act(g) * u
        ctx.save_for_backward(g if need_g or need_u else None, u if need_g else None)
        ctx.act = act
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh: Tensor):
        g, u = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = dh.to(torch.bfloat16).contiguous()
        if ctx.act is None:
            dg, du = kernels().backward(dh, g, u, need_g, need_u)
            return dg, du, None
        with torch.enable_grad():  # another activation: act(gate) again, and its gradient by autograd
            x = g.detach().requires_grad_(need_g)
            a = ctx.act(x)
        du = dh * a.detach() if need_u else None
        dg = torch.autograd.grad(a, x, dh * u)[0] if need_g else None
        return dg, du, None


def swiglu(g: Tensor, u: Tensor, act: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """act(g) * u for bf16 on CPU (``fits``): act None is silu, in C; another activation runs as PyTorch ops."""
    return _SwiGLU.apply(g, u, act)

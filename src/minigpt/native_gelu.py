"""GELU for bf16 on CPU: GPT-2's tanh form in C both ways, and the exact GELU's gradient in C.

    y = tanh_gelu(h)                # F.gelu(h, approximate="tanh"): in C where fits(h) (bf16 on CPU, contiguous,
                                    # kernels built), else PyTorch's
    y = exact_gelu(h)               # F.gelu(h): PyTorch's forward; where fits(h), its gradient in C
    y = gelu(h, approximate)        # either, by F.gelu's `approximate` ("none" or "tanh")
    y, dh = gelu_values(h, approximate), gelu_grad(dy, h, approximate)   # the same, for a Function applying it

GPT-2's checkpoints use ``gelu_new``, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` (MiniGPT's activation
"gelu_tanh"). PyTorch computes it per value in fp32 with a vectorized tanh; on a 2-core AMD EPYC its bf16 forward
and backward at GPT-2's MLP width (1,024 × 3,072) took 2.1 ms each, five times the exact GELU's (0.4 and 0.8 ms).
A GPT-2-small-shaped bf16 LoRA step (2 × 512 tokens, r 8 on the six Linears of each block) took 1,081 ms with
these kernels and 1,118 ms without (medians of 9 steps, the two models alternating in one process, 2026-12-03).

Here, with u = √(2/π)·(x + 0.044715·x³) and 1 + tanh(u) = 2·σ(2u): forward y = bf16(x · σ(2u)); backward
dx = bf16(dy · (σ + 2·x·σ·(1 - σ)·√(2/π)·(1 + 3·0.044715·x²))), the derivative PyTorch writes with tanh (its
1 - tanh² is 4·σ·(1 - σ)). σ is ``minikernels.bf16_exp``'s (about 2e-6 relative), so the fp32 values are within
a few units of PyTorch's: for x ≥ -3, 99.6% of the rounded values equal PyTorch's and the rest are one bf16 unit
away; below -3 (|y| < 0.004, where PyTorch's 1 + tanh(u) cancels) about a quarter differ, both as far from the
exact value on average (fp64: 1.0e-6 against 1.0e-6; 3 M values of N(0, 2²)). NaN, ±inf: PyTorch's results
(gelu(-inf) is NaN in both). It saves its input, as F.gelu does (``minituner.planner`` counts that). Forward
and backward at 1,024 × 3,072: 0.66 and 0.84 ms here, against PyTorch's 2.1 and 2.1.

The exact GELU (MiniGPT's "gelu", a Hugging Face config's hidden_act "gelu"): its gradient dy·(Φ(x) + x·φ(x))
in C, Φ through erfc's Abramowitz-Stegun form (PyTorch's erf is the same formula) and one e^(-x²/2) serving
both Φ and the density φ, where PyTorch's gelu_backward computes erf and exp apart. For x ≥ -3, 99.99% of the
rounded gradients equal PyTorch's and the rest are one bf16 unit away; below, where PyTorch's 1 + erf(x/√2)
cancels (its gradient is 0 from x = -5.4 on), ours stays within a bf16 unit of the exact value (99.96% of
3 M values of N(0, 2²) exactly rounded, against PyTorch's 99.44%). At 1,024 × 2,048 (the bench's GPT shape)
it takes 0.33 ms alone against PyTorch's 0.42; in that bf16 QLoRA step, 2.3 ms less a step at about 185 ms,
5.4 ms less at about 207 ms (medians of 96 and 64 alternating pairs, one process, 2026-12-05). The forward
stays PyTorch's: on one thread our C took 0.57 ms against its 0.40, and the step ran 1.4 ms slower with it. It
saves its input, as F.gelu does.

The C loops read their inputs ahead in software (``minikernels.stream_prefetch``: at 1,024 × 2,048 the exact
GELU's gradient 1.23 → 0.96 ms, the tanh form's forward 1.13 → 0.83 ms, 2 threads, 2026-12-06).

Used only where the C was built with AVX-512 (``gelu_vectorized``); elsewhere, and for fp32, fp16 and CUDA, the
model calls ``F.gelu``.

``gelu_values`` and ``gelu_grad`` are what the two Functions below compute, also for one that applies GELU
inside itself (minituner's ``lora_product``, for an MLP's second Linear); ``miniquant.nf4_matmul`` applies the
same slopes (``minikernels.gelu_slope``, shared with the C here) inside its input-gradient product.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from minikernels.bf16_exp import BF16_EXP_C, BF16_SIGMOID_C
from minikernels.build import OPENMP_PRELUDE, KernelFamily, ThreadSplit, parallel_entry
from minikernels.gelu_slope import GELU_SLOPE_C
from minikernels.stream_prefetch import STREAM_PREFETCH_C

CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
LIBS = ["-lm"]
MIN_VALUES_PER_THREAD = 1 << 16  # fewer values stay on the calling thread (handing work over costs ~50 µs)
CHUNK_VALUES = 1 << 17  # threads take values in chunks of this many

_SOURCE = OPENMP_PRELUDE + BF16_EXP_C + BF16_SIGMOID_C + GELU_SLOPE_C + STREAM_PREFETCH_C + r"""
int gelu_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* 16 values: y = bf16(x · σ(2u)), u = K_BETA · (x + K_KAPPA · x³) */
static inline void gelu_forward16(const uint16_t* x, uint16_t* y) {
    __m512 v = load16(x);
    __m512 inner = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(K_KAPPA), _mm512_mul_ps(v, _mm512_mul_ps(v, v))));
    store16(y, _mm512_mul_ps(v, sigmoid16(_mm512_mul_ps(_mm512_set1_ps(2.0f * K_BETA), inner))));
}

/* 16 values: dx = bf16(dy · (s + 2·x·s·(1 - s)·K_BETA·(1 + 3·K_KAPPA·x²))), s = σ(2u) (minikernels.gelu_slope) */
static inline void gelu_backward16(const uint16_t* dy, const uint16_t* x, uint16_t* dx) {
    store16(dx, _mm512_mul_ps(load16(dy), gelu_tanh_slope16(load16(x))));
}

/* 16 values: dx = bf16(dy · (Φ(x) + x·φ(x))) (minikernels.gelu_slope) */
static inline void gelu_erf_backward16(const uint16_t* dy, const uint16_t* x, uint16_t* dx) {
    store16(dx, _mm512_mul_ps(load16(dy), gelu_erf_slope16(load16(x))));
}
#endif

/* values [i0, i1) of dy, x and dx by KERNEL16, 16 at a time; the last n < 16 through the same code in a
   zero-padded block (TAIL16) */
#define BACKWARD_RANGE(KERNEL16) do { \
    int64_t i = i0; \
    for (; i + 16 <= i1; i += 16) { \
        if ((i & 31) == 0) { prefetch_ahead(dy + i); prefetch_ahead(x + i); }  /* once a line (stream_prefetch) */ \
        KERNEL16(dy + i, x + i, dx + i); \
    } \
    if (i < i1) { \
        TAIL16(i1 - i, dy + i, dyt); \
        TAIL16(i1 - i, x + i, xt); \
        uint16_t dxt[16]; \
        KERNEL16(dyt, xt, dxt); \
        memcpy(dx + i, dxt, (size_t)(i1 - i) * 2); \
    } \
} while (0)

/* values [i0, i1) by gelu_forward16; the last n < 16 through the same code in a zero-padded block (TAIL16) */
void gelu_tanh_forward(const uint16_t* x, int64_t i0, int64_t i1, uint16_t* y) {
#ifdef __AVX512F__
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        if ((i & 31) == 0) prefetch_ahead(x + i);  /* once a line (stream_prefetch) */
        gelu_forward16(x + i, y + i);
    }
    if (i < i1) {
        TAIL16(i1 - i, x + i, xt);
        uint16_t yt[16];
        gelu_forward16(xt, yt);
        memcpy(y + i, yt, (size_t)(i1 - i) * 2);
    }
#endif
}

/* values [i0, i1) by gelu_backward16 */
void gelu_tanh_backward(const uint16_t* dy, const uint16_t* x, int64_t i0, int64_t i1, uint16_t* dx) {
#ifdef __AVX512F__
    BACKWARD_RANGE(gelu_backward16);
#endif
}

/* values [i0, i1) by gelu_erf_backward16 */
void gelu_erf_backward(const uint16_t* dy, const uint16_t* x, int64_t i0, int64_t i1, uint16_t* dx) {
#ifdef __AVX512F__
    BACKWARD_RANGE(gelu_erf_backward16);
#endif
}

/* the three above over OpenMP's threads, in `chunks` ranges (minikernels.build's MK_PARALLEL_RANGES) */
void gelu_tanh_forward_parallel(const uint16_t* x, int64_t b0, int64_t b1, uint16_t* y, int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, i0, i1, gelu_tanh_forward(x, i0, i1, y));
}

void gelu_tanh_backward_parallel(const uint16_t* dy, const uint16_t* x, int64_t b0, int64_t b1, uint16_t* dx,
                                 int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, i0, i1, gelu_tanh_backward(dy, x, i0, i1, dx));
}

void gelu_erf_backward_parallel(const uint16_t* dy, const uint16_t* x, int64_t b0, int64_t b1, uint16_t* dx,
                                int64_t chunks, int threads) {
    MK_PARALLEL_RANGES(b0, b1, i0, i1, gelu_erf_backward(dy, x, i0, i1, dx));
}
"""


class GeluKernels:
    """The compiled kernels, values split across threads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._forward = lib.gelu_tanh_forward
        self._forward.argtypes = [ptr, i64, i64, ptr]
        self._forward.restype = None
        self._forward_parallel = parallel_entry(lib, self._forward)  # over OpenMP's threads
        self._backward = {}  # exact -> (serial, parallel)
        for exact, serial in ((False, lib.gelu_tanh_backward), (True, lib.gelu_erf_backward)):
            serial.argtypes, serial.restype = [ptr, ptr, i64, i64, ptr], None
            self._backward[exact] = (serial, parallel_entry(lib, serial))
        self._threads = ThreadSplit("minigpt-gelu", openmp=bool(lib.mk_openmp()))

    def forward(self, x: Tensor) -> Tensor:
        """gelu_tanh(x) for a contiguous bf16 x."""
        y = torch.empty_like(x)
        self._threads.run(x.numel(), 1, lambda i0, i1: self._forward(x.data_ptr(), i0, i1, y.data_ptr()),
                          MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda i0, i1, c, t: self._forward_parallel(x.data_ptr(), i0, i1, y.data_ptr(), c, t))
        return y

    def backward(self, dy: Tensor, x: Tensor, exact: bool = False) -> Tensor:
        """The gradient for x, from contiguous bf16 dy and x of one shape: of the tanh form, or of the exact GELU."""
        dx = torch.empty_like(x)
        args = (dy.data_ptr(), x.data_ptr())
        serial, parallel = self._backward[exact]
        self._threads.run(x.numel(), 1, lambda i0, i1: serial(*args, i0, i1, dx.data_ptr()),
                          MIN_VALUES_PER_THREAD, CHUNK_VALUES,
                          lambda i0, i1, c, t: parallel(*args, i0, i1, dx.data_ptr(), c, t))
        return dx


_FAMILY = KernelFamily("bf16_gelu", _SOURCE, CFLAGS, "minigpt's native GELU (tanh) kernels", GeluKernels, LIBS,
                       vectorized="gelu_vectorized", parallel=True)
_usable = _FAMILY.usable  # None for a library built without AVX-512


def kernels() -> GeluKernels | None:
    """The native GELU kernels, built on first use; None when disabled (MINIQUANT_NATIVE=0), unavailable or not
    vectorized (no AVX-512)."""
    return _FAMILY.kernels()


def fits(x: Tensor) -> bool:
    """Whether gelu_tanh takes x: bf16 on CPU, contiguous, and the kernels built."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous() and kernels() is not None


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x if ctx.needs_input_grad[0] else None)  # what F.gelu keeps: its input
        return gelu_values(x, "tanh")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x, = ctx.saved_tensors
        return gelu_grad(dy, x, "tanh")


class _GeluExact(torch.autograd.Function):
    """PyTorch's F.gelu forward (faster here than ours), the gradient in C."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x if ctx.needs_input_grad[0] else None)  # what F.gelu keeps: its input
        return gelu_values(x, "none")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x, = ctx.saved_tensors
        return gelu_grad(dy, x, "none")


def tanh_gelu(x: Tensor) -> Tensor:
    """F.gelu(x, approximate="tanh"): through the C kernels where they take x (``fits``), else PyTorch's."""
    return _GeluTanh.apply(x) if fits(x) else F.gelu(x, approximate="tanh")


def exact_gelu(x: Tensor) -> Tensor:
    """F.gelu(x): PyTorch's forward, and where the kernels take x (``fits``) and it needs a gradient, the C one."""
    return _GeluExact.apply(x) if fits(x) and x.requires_grad else F.gelu(x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """F.gelu(x, approximate=approximate), either form as above."""
    if approximate == "tanh":
        return tanh_gelu(x)
    return exact_gelu(x) if approximate == "none" else F.gelu(x, approximate=approximate)  # (which names the error)


def gelu_values(x: Tensor, approximate: str = "none") -> Tensor:
    """gelu(x, approximate)'s values without autograd, for a Function that applies GELU inside its own forward
    (``minituner.lora_product``): the tanh form in C where ``fits``, else F.gelu (the same bits as gelu)."""
    if approximate == "tanh" and fits(x):
        return kernels().forward(x)
    return F.gelu(x, approximate=approximate)


def gelu_grad(dy: Tensor, x: Tensor, approximate: str = "none") -> Tensor:
    """The gradient for x of gelu(x, approximate) given dy, as gelu's own backward computes it: in C where ``fits``
    (x needing a gradient), else aten's gelu_backward (F.gelu's)."""
    if approximate in ("none", "tanh") and fits(x):
        return kernels().backward(dy.to(torch.bfloat16).contiguous(), x, exact=approximate == "none")
    return torch.ops.aten.gelu_backward(dy.to(x.dtype), x, approximate=approximate)

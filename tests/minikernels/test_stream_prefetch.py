"""minikernels.stream_prefetch: the streaming kernels read ahead of their data, never past it.

prefetch_ahead reads STREAM_AHEAD_BYTES past where a kernel is: at a tensor's end that is memory the process may
not own. A prefetch never faults, so a tensor that ends right before a page the process may not touch (a guard
page, PROT_NONE) gives the same values as one in ordinary memory.
"""
import ctypes
import mmap

import pytest
import torch

from minigpt import native_gelu, native_loss, native_swiglu
from minikernels import stream_prefetch

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # mprotect: no access (sys/mman.h)


def _before_guard_page(t: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """A copy of t whose last byte is the last before a PROT_NONE page (and the mapping that holds it)."""
    nbytes = t.numel() * t.element_size()
    pages = -(-nbytes // PAGE)
    region = mmap.mmap(-1, (pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + pages * PAGE, PAGE, PROT_NONE) == 0
    start = pages * PAGE - nbytes
    copy = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start).view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy, region


def test_the_c_reads_ahead_the_distance_named_in_python():
    assert f"#define STREAM_AHEAD_BYTES {stream_prefetch.AHEAD_BYTES}" in stream_prefetch.STREAM_PREFETCH_C


@pytest.mark.skipif(native_loss.kernels() is None, reason="no C compiler or no AVX-512: the kernels are not used")
def test_the_loss_reads_logits_that_end_at_a_guard_page():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=g).to(torch.bfloat16)  # 16,000 bytes: the last page part-filled
    targets = torch.randint(0, 1000, (8,), generator=g)
    scale = torch.full((8,), 0.125)
    k = native_loss.kernels()
    lse = k.logsumexp(logits)
    want = k.softmax_grad(logits, lse, targets, scale)
    guarded, region = _before_guard_page(logits)
    assert torch.equal(k.logsumexp(guarded), lse)
    k.softmax_grad(guarded, lse, targets, scale, out=guarded)  # in place, as a training step runs it
    assert torch.equal(guarded.view(torch.int16), want.view(torch.int16))
    del guarded
    region.close()


@pytest.mark.skipif(native_swiglu.kernels() is None or native_gelu.kernels() is None,
                    reason="no C compiler or no AVX-512: the kernels are not used")
def test_the_activations_read_inputs_that_end_at_a_guard_page():
    g = torch.Generator().manual_seed(1)
    a, b, d = (torch.randn(4, 1000, generator=g).to(torch.bfloat16) for _ in range(3))
    sw, ge = native_swiglu.kernels(), native_gelu.kernels()
    want = (sw.forward(a, b), *sw.backward(d, a, b, True, True), ge.forward(a), ge.backward(d, a),
            ge.backward(d, a, exact=True))
    (ga, ra), (gb, rb), (gd, rd) = (_before_guard_page(t) for t in (a, b, d))
    got = (sw.forward(ga, gb), *sw.backward(gd, ga, gb, True, True), ge.forward(ga), ge.backward(gd, ga),
           ge.backward(gd, ga, exact=True))
    for w, o in zip(want, got):
        assert torch.equal(w.view(torch.int16), o.view(torch.int16))
    del ga, gb, gd
    for r in (ra, rb, rd):
        r.close()

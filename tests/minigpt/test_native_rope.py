"""minigpt.native_rope: RoPE on q and k in C against apply_rope's PyTorch bf16 ops and their autograd, to the bit."""

import pytest
import torch

from minigpt import native_rope
from minigpt.decoder import Decoder, DecoderConfig, apply_rope, signed_sin

kernels = native_rope.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler or no AVX-512: the kernel is not used")


def _projections(B, T, Hq, Hk, d, seed=0, scale=1.0):
    """q and k as the decoder hands them over: (B, T, heads·d) projections seen as (B, heads, T, d), leaves that
    take a gradient; the rotary tables (T, d) in bf16, the sine signed."""
    g = torch.Generator().manual_seed(seed)
    qp = (torch.randn(B, T, Hq * d, generator=g) * scale).bfloat16().requires_grad_()
    kp = (torch.randn(B, T, Hk * d, generator=g) * scale).bfloat16().requires_grad_()
    pos = torch.arange(T, dtype=torch.float32)[:, None] * (1e-2 + torch.rand(d // 2, generator=g))[None, :]
    emb = torch.cat((pos, pos), dim=-1)
    return qp, kp, emb.cos().bfloat16(), signed_sin(emb.sin().bfloat16())


def _heads(p, B, T, H, d):
    return p.view(B, T, H, d).transpose(1, 2)


def _both(qp, kp, cos, sin, B, T, Hq, Hk, d, native, grads):
    """(q', k', dq, dk): rotated by the C kernel or by apply_rope, then backward from `grads`."""
    qp, kp = qp.detach().clone().requires_grad_(), kp.detach().clone().requires_grad_()
    q, k = _heads(qp, B, T, Hq, d), _heads(kp, B, T, Hk, d)
    if native:
        assert native_rope.fits(q, k, cos, sin)
        rq, rk = native_rope.rope_qk(q, k, cos, sin)
    else:
        rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.autograd.backward((rq, rk), grads)
    return rq, rk, qp.grad, kp.grad


def _bits(t):
    return t.view(torch.int16)


def _layout(t):
    """t's strides where its size is above one (a dimension of one has any stride)."""
    return [st for n, st in zip(t.shape, t.stride()) if n > 1]


@needs_kernels
@pytest.mark.parametrize("B, T, Hq, Hk, d", [(1, 512, 32, 8, 64), (2, 37, 4, 4, 128), (1, 5, 3, 1, 32),
                                             (2, 19, 2, 1, 256), (1, 1, 2, 2, 64)])
def test_values_and_gradients_equal_apply_rope(B, T, Hq, Hk, d):
    qp, kp, cos, sin = _projections(B, T, Hq, Hk, d, seed=T)
    g = torch.Generator().manual_seed(1)
    grads = tuple(torch.randn(B, H, T, d, generator=g).bfloat16() for H in (Hq, Hk))
    ours = _both(qp, kp, cos, sin, B, T, Hq, Hk, d, True, grads)
    theirs = _both(qp, kp, cos, sin, B, T, Hq, Hk, d, False, grads)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
    for a, b in zip(ours[:2], theirs[:2]):  # laid out (B, T, h, d)
        assert _layout(a) == _layout(b)


@needs_kernels
def test_contiguous_heads_and_gradients_of_any_layout():
    """q and k contiguous as (B, h, T, d), and gradients arriving as views of another layout, give the same bits."""
    B, T, H, d = 2, 24, 4, 64
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, H, T, d, generator=g).bfloat16().requires_grad_() for _ in range(2))
    cos, sin = (torch.randn(T, d, generator=g).bfloat16() for _ in range(2))
    dq = torch.randn(B, T, H, d, generator=g).bfloat16().transpose(1, 2)  # a (B, T, h, d) gradient
    dk = torch.randn(B, H, T, d, generator=g).bfloat16()
    rq, rk = native_rope.rope_qk(q, k, cos, sin)
    torch.autograd.backward((rq, rk), (dq, dk))
    q2, k2 = (t.detach().clone().requires_grad_() for t in (q, k))
    torch.autograd.backward((apply_rope(q2, cos, sin), apply_rope(k2, cos, sin)), (dq, dk))
    assert torch.equal(_bits(rq), _bits(apply_rope(q, cos, sin).detach()))
    assert torch.equal(_bits(q.grad), _bits(q2.grad)) and torch.equal(_bits(k.grad), _bits(k2.grad))


@needs_kernels
def test_nan_inf_and_denormals_as_pytorch():
    B, T, H, d = 1, 4, 2, 32
    qp, kp, cos, sin = _projections(B, T, H, H, d, seed=5)
    with torch.no_grad():
        qp[0, 1, 3] = float("nan")
        qp[0, 2, 40] = float("inf")
        kp[0, 3, :] = 3e-39  # bf16 denormals: their products with cos and sin round as PyTorch rounds them
    grads = tuple(torch.ones(B, H, T, d).bfloat16() for _ in range(2))
    grads[0][0, 0, 0, 0] = float("nan")
    ours = _both(qp, kp, cos, sin, B, T, H, H, d, True, grads)
    theirs = _both(qp, kp, cos, sin, B, T, H, H, d, False, grads)
    for i, (a, b) in enumerate(zip(ours, theirs)):  # (q', k', dq, dk): NaN in q and in q's gradient
        assert torch.equal(a.isnan(), b.isnan()) and bool(a.isnan().any()) == (i in (0, 2))
        assert torch.equal(_bits(a[~a.isnan()]), _bits(b[~b.isnan()]))
    assert (ours[1] != 0).any() and (ours[1].abs() < torch.finfo(torch.bfloat16).tiny).any()  # denormals kept


@needs_kernels
def test_one_thread_gives_the_bits_of_two():
    B, T, Hq, Hk, d = 1, 512, 16, 4, 64  # 655,360 values: split over the threads where there are two
    qp, kp, cos, sin = _projections(B, T, Hq, Hk, d, seed=7)
    grads = tuple(torch.randn(B, H, T, d).bfloat16() for H in (Hq, Hk))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _both(qp, kp, cos, sin, B, T, Hq, Hk, d, True, grads)
        torch.set_num_threads(max(2, before))
        two = _both(qp, kp, cos, sin, B, T, Hq, Hk, d, True, grads)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(_bits(a), _bits(b))


@needs_kernels
def test_a_gradient_for_q_alone_and_only_the_tables_saved():
    """k's output unused: k's gradient is zero; autograd keeps cos and sin, nothing of q's or k's size."""
    B, T, H, d = 1, 8, 2, 64
    qp, kp, cos, sin = _projections(B, T, H, H, d, seed=9)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rq, _ = native_rope.rope_qk(_heads(qp, B, T, H, d), _heads(kp, B, T, H, d), cos, sin)
    assert sorted(t.data_ptr() for t in saved) == sorted((cos.data_ptr(), sin.data_ptr()))
    rq.float().sum().backward()
    q2 = qp.detach().clone().requires_grad_()
    apply_rope(_heads(q2, B, T, H, d), cos, sin).float().sum().backward()
    assert torch.equal(_bits(qp.grad), _bits(q2.grad)) and not kp.grad.any()


def test_what_it_does_not_take():
    B, T, H, d = 1, 4, 2, 64
    qp, kp, cos, sin = _projections(B, T, H, H, d)
    q, k = _heads(qp.detach(), B, T, H, d), _heads(kp.detach(), B, T, H, d)
    assert native_rope.fits(q, k, cos, sin) == (kernels is not None)
    assert not native_rope.fits(q.float(), k.float(), cos.float(), sin.float())  # fp32: PyTorch's ops
    assert not native_rope.fits(q, k, cos[:3], sin[:3])  # tables of another length
    assert not native_rope.fits(q[..., :48], k[..., :48], cos[:, :48], sin[:, :48])  # d not a multiple of 32
    assert not native_rope.fits(q.transpose(2, 3), k.transpose(2, 3), cos, sin)  # d not contiguous
    assert not native_rope.fits(q, k, cos.t().contiguous().t(), sin)  # a table not contiguous


def _decoder(d_head, n_head=4, n_kv_head=2):
    cfg = DecoderConfig(vocab_size=64, block_size=64, d_model=n_head * d_head, n_layer=2, n_head=n_head,
                        n_kv_head=n_kv_head, d_ff=96)
    torch.manual_seed(0)
    return Decoder(cfg).to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("d_head", [32, 64])
def test_a_bf16_decoder_trains_and_generates_with_the_same_bits(d_head, monkeypatch):
    """The Decoder takes the C kernel in bf16 (forward, backward, and generation's cached positions) and gives the
    bits PyTorch's ops give."""
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    real = native_rope.rope_qk
    monkeypatch.setattr(native_rope, "rope_qk", lambda *a: calls.append(1) or real(*a))

    def run():
        model = _decoder(d_head)
        loss = model(idx).float().logsumexp(-1).mean()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        with torch.no_grad():
            cache = model.new_kv_cache(16)
            first = model(idx[:, :8], cache=cache)
            later = model(idx[:, 8:10], cache=cache)  # positions 8 and 9: the tables from an offset
        return [loss.detach(), first, later, *grads]

    ours = run()
    assert calls
    monkeypatch.setattr(native_rope, "fits", lambda *a: False)
    calls.clear()
    theirs = run()
    assert not calls
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_a_build_without_avx512_is_not_used(plain_build):
    lib = plain_build("bf16_rope_plain", native_rope)
    assert lib.rope_vectorized() == 0 and native_rope._FAMILY.usable(lib) is None
"""Fixtures of the attention tests (test_native_attention, test_fused_attention): what both paths are held to; and
``plain_build``, a bf16 kernel family built without AVX-512 (the native_* tests: such a build is not used)."""
import ctypes
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F


def visible(T, window=None):
    """(T, T) bool: query i sees key j (causal; at most `window` keys back, itself included, where given)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def reference(q, k, v, window=None):
    """fp32 attention of the same values, K/V heads repeated to the query heads (head i reads K/V head i // g)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(q.shape[2], window))


def rel(a, b):
    """The largest difference relative to b's largest magnitude (the difference itself where b is all 0)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1.0)).item()


def grad_fn_names(y):
    """The class names of every autograd node behind y."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return {type(f).__name__ for f in seen}


def as_close_as_sdpa(ours, sdpa, want):
    """ours within twice SDPA's error (both on the same bf16 values) of fp32 attention's `want`, plus 2^-8."""
    return rel(ours, want) <= 2 * rel(sdpa, want) + 2 ** -8


def checkpointing_changes_nothing(model, idx):
    """model's parameter gradients on idx are the same bits with gradient checkpointing as without."""
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.grad_checkpoint = ckpt
        model(idx).float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.grad_checkpoint = False
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.fixture
def attention_checks():
    """visible, reference (fp32 attention of the same values), rel (a relative error), as_close_as_sdpa,
    grad_fn_names and checkpointing_changes_nothing."""
    return SimpleNamespace(visible=visible, reference=reference, rel=rel, as_close_as_sdpa=as_close_as_sdpa,
                           grad_fn_names=grad_fn_names, checkpointing_changes_nothing=checkpointing_changes_nothing)


@pytest.fixture
def plain_build(tmp_path, monkeypatch):
    """(name, module) -> the module's C (_SOURCE, CFLAGS, LIBS) built without AVX-512 into a cache of its own, loaded;
    skips where there is no C compiler or it does not know -mno-avx512f (not x86)."""
    from minikernels.build import build_library, find_compiler

    def build(name, module):
        compiler = find_compiler()
        if compiler is None:
            pytest.skip("no C compiler")
        monkeypatch.setenv("MINIQUANT_CACHE", str(tmp_path))
        try:
            path = build_library(name, module._SOURCE, module.CFLAGS + ["-mno-avx512f"], compiler, module.LIBS)
        except RuntimeError as e:
            pytest.skip(f"cannot build without AVX-512 here: {e}")
        return ctypes.CDLL(str(path))
    return build

"""minigpt.cross_entropy: fp32 logits through F.cross_entropy as they are (large ones in a training loss chunked, in
place); bf16/fp16 logits in fp32 chunks."""
import pytest
import torch
import torch.nn.functional as F

import minigpt.cross_entropy as ce
from minigpt import native_loss
from minigpt.cross_entropy import IGNORE_INDEX, ChunkedCrossEntropy, chunk_rows, cross_entropy


def _case(n=12, vocab=50, dtype=torch.bfloat16, ignored=(3, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[list(ignored)] = IGNORE_INDEX
    return logits, targets


def _reference(logits, targets, reduction):
    """transformers' way: upcast, then F.cross_entropy; the gradient cast back to the logits' dtype."""
    z = logits.detach().float().clone().requires_grad_()
    loss = F.cross_entropy(z, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    loss.backward(torch.tensor(1.7))  # any incoming gradient
    return loss.detach(), z.grad


def _ours(logits, targets, reduction):
    z = logits.detach().clone().requires_grad_()
    loss = cross_entropy(z, targets, reduction)
    loss.backward(torch.tensor(1.7))
    return loss.detach(), z.grad


@pytest.fixture(params=["native", "torch ops"])
def loss_path(request, monkeypatch):
    """Each test runs with minigpt.native_loss's kernels (bf16 on CPU) and with the PyTorch ops alone."""
    if request.param == "native":
        if native_loss.kernels() is None:
            pytest.skip("no C compiler: the native loss kernels are not built")
    else:
        monkeypatch.setattr(native_loss, "kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1 << 19, 50, 150])  # one chunk; one row a chunk; 3 rows, the last chunk short
def test_low_precision_logits_give_the_upcast_loss_and_gradient(dtype, reduction, chunk, monkeypatch, loss_path):
    monkeypatch.setitem(ce.CHUNK_ELEMENTS, "cpu", chunk)
    logits, targets = _case(dtype=dtype)
    ref_loss, ref_grad = _reference(logits, targets, reduction)
    loss, grad = _ours(logits, targets, reduction)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)  # same fp32 arithmetic, another order
    # the same fp32 gradient, rounded once to the logits' dtype: at most one unit in the last place apart
    torch.testing.assert_close(grad.float(), ref_grad, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                               atol=1e-6)
    assert torch.all(grad[[3, 7]] == 0)  # ignored targets get no gradient


def test_fp32_logits_are_f_cross_entropy_exactly():
    logits, targets = _case(dtype=torch.float32)
    for reduction in ("mean", "sum"):
        ref_loss, ref_grad = _reference(logits, targets, reduction)
        loss, grad = _ours(logits, targets, reduction)
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_batched_logits_and_targets_are_flattened():
    logits, targets = _case(n=12)
    a = cross_entropy(logits.view(3, 4, -1), targets.view(3, 4))
    assert torch.equal(a, cross_entropy(logits, targets))


def test_no_counted_target(loss_path):
    logits, _ = _case(n=4, ignored=())
    targets = torch.full((4,), IGNORE_INDEX)
    assert torch.isnan(cross_entropy(logits, targets)) and torch.isnan(F.cross_entropy(logits.float(), targets))
    z = logits.detach().clone().requires_grad_()
    total = cross_entropy(z, targets, "sum")
    total.backward()
    assert total.item() == 0 and torch.all(z.grad == 0)


def test_keeps_the_logits_in_their_dtype_and_one_fp32_value_per_row(loss_path):
    """What the backward keeps (the planner's 'logits kept by the loss' and 'loss logsumexp'): no (N, V) fp32."""
    logits, targets = _case(n=12, vocab=50)
    z = logits.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cross_entropy(z, targets)
    shapes = sorted((tuple(t.shape), str(t.dtype)) for t in saved)
    assert shapes == sorted([((), "torch.float32"), ((12,), "torch.int64"), ((12,), "torch.float32"),
                             ((12, 50), "torch.bfloat16")])


def test_chunk_rows_and_bad_arguments():
    assert chunk_rows(128_256) == 4 and chunk_rows(4096) == 128 and chunk_rows(10 ** 7) == 1
    assert chunk_rows(128_256, "cuda") == 130  # 64 Mi values on an accelerator: fewer kernel launches
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(*_case(), reduction="none")
    logits, targets = _case(n=5, ignored=(3,))
    with pytest.raises(ValueError, match=r"need 5 targets, got shape \(1,\)"):  # never broadcast one target
        cross_entropy(logits, targets[:1])


def test_default_dtype_does_not_leak_into_the_gradient(loss_path):
    logits, targets = _case()
    z = logits.detach().clone().requires_grad_()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cross_entropy(z, targets).backward()
    finally:
        torch.set_default_dtype(previous)
    assert z.grad.dtype == torch.bfloat16


def test_out_of_range_target_is_refused(loss_path):
    logits, targets = _case()
    targets[0] = 50
    with pytest.raises(RuntimeError):
        ChunkedCrossEntropy.apply(logits, targets, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_overwrite_logits_writes_the_same_gradient_over_them(dtype, reduction, monkeypatch, loss_path):
    monkeypatch.setitem(ce.CHUNK_ELEMENTS, "cpu", 150)  # several chunks on the PyTorch path
    logits, targets = _case(dtype=dtype)
    ref_loss, ref_grad = _ours(logits, targets, reduction)
    leaf = logits.detach().clone().requires_grad_()
    z = leaf * 1  # a non-leaf, as a head's output: the gradient reaches the leaf through it
    loss = cross_entropy(z, targets, reduction, overwrite_logits=True)
    version = z._version
    loss.backward(torch.tensor(1.7))
    assert torch.equal(loss.detach(), ref_loss)
    assert torch.equal(leaf.grad, ref_grad) and torch.equal(z.detach(), ref_grad)  # the gradient, over the logits
    assert z._version > version


def test_overwritten_logits_another_node_saved_raise(loss_path):
    """A node that saved the same logits (their tanh's backward reads its output) raises instead of reading the
    gradient as logits."""
    logits, targets = _case()
    z = logits.detach().clone().requires_grad_().tanh()
    loss = cross_entropy(z, targets, overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_overwrite_logits_leaves_small_fp32_logits_alone():
    logits, targets = _case(dtype=torch.float32)
    assert not ce.fp32_loss_chunked(*logits.shape)
    z = logits.clone().requires_grad_()
    cross_entropy(z, targets, overwrite_logits=True).backward()
    assert torch.equal(z.detach(), logits)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1 << 19, 150])  # one chunk; 3 rows a chunk, the last one short
def test_large_fp32_logits_overwritten_give_f_cross_entropy_to_rounding(reduction, chunk, monkeypatch):
    """fp32 logits of FP32_CHUNKED_MIN_VALUES or more, in a training loss: chunked, the softmax computed in place
    over them, the same loss and gradient as F.cross_entropy but for the order of fp32 sums."""
    monkeypatch.setattr(ce, "FP32_CHUNKED_MIN_VALUES", 12 * 50)
    monkeypatch.setitem(ce.CHUNK_ELEMENTS, "cpu", chunk)
    logits, targets = _case(dtype=torch.float32)
    assert ce.fp32_loss_chunked(*logits.shape)
    ref_loss, ref_grad = _reference(logits, targets, reduction)
    leaf = logits.clone().requires_grad_()
    z = leaf * 1  # a non-leaf, as a head's output
    loss = cross_entropy(z, targets, reduction, overwrite_logits=True)
    assert loss.grad_fn.name() == "ChunkedCrossEntropyBackward"
    version = z._version
    loss.backward(torch.tensor(1.7))
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(z.detach(), leaf.grad) and z._version > version  # the gradient, over the logits
    assert torch.all(leaf.grad[[3, 7]] == 0)


def test_the_chunked_function_refuses_fp32_logits_it_may_not_overwrite():
    logits, targets = _case(dtype=torch.float32)
    with pytest.raises(ValueError, match="overwrite"):
        ChunkedCrossEntropy.apply(logits, targets, True)

"""minigpt.native_loss: the bf16 cross-entropy kernels against PyTorch's fp32 arithmetic on the same values."""
import os
import subprocess
import sys

import pytest
import torch

from minigpt import native_loss
from minigpt.cross_entropy import IGNORE_INDEX, cross_entropy

kernels = native_loss.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler: the native loss kernels are not built")


def _logits(n, vocab, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * scale).to(torch.bfloat16)


def _reference_grad(z, targets, row_scale):
    p = torch.softmax(z.float(), dim=-1)
    counts = targets >= 0
    p[torch.arange(len(targets))[counts], targets[counts]] -= 1.0
    return p * row_scale[:, None]


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 63, 64, 100, 1000, 4099])  # every tail of the 16- and 64-wide loops
def test_logsumexp_and_gradient_match_fp32_torch(vocab):
    z = _logits(9, vocab, seed=vocab)
    torch.testing.assert_close(kernels.logsumexp(z), torch.logsumexp(z.float(), -1), rtol=1e-6, atol=1e-6)
    targets = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(1))
    targets[4] = -1  # a row that does not count: no one-hot, scale 0
    row_scale = torch.linspace(0.1, 2.0, 9)
    row_scale[4] = 0.0
    grad = kernels.softmax_grad(z, kernels.logsumexp(z), targets, row_scale)
    assert grad.dtype == torch.bfloat16 and grad.shape == z.shape
    # one rounding of a value within about one fp32 ulp of torch's: at most one bf16 unit apart
    torch.testing.assert_close(grad.float(), _reference_grad(z, targets, row_scale), rtol=2 ** -7, atol=1e-7)
    assert torch.all(grad[4] == 0)


@needs_kernels
def test_a_large_vocabulary_row_sums_accurately():
    """128,256 values a row (Llama 3): 64 running sums keep the logsumexp within a few fp32 ulps of torch's."""
    z = _logits(4, 128_256, scale=4.0)
    torch.testing.assert_close(kernels.logsumexp(z), torch.logsumexp(z.float(), -1), rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("vocab", [40, 1000])  # within the 16-wide loop's tail, and across whole 64-value steps
def test_rows_with_inf_or_nan_follow_torch(vocab):
    z = _logits(6, vocab)
    z[0, 3] = float("inf")
    z[1, 5] = float("nan")
    z[2] = float("-inf")
    z[3, :: 7] = float("-inf")  # masked logits in a finite row: exact zeros in the sum, the fast path
    z[4, vocab - 1] = float("inf")  # in the last value
    z[5, 0] = float("-inf")
    torch.testing.assert_close(kernels.logsumexp(z), torch.logsumexp(z.float(), -1), rtol=1e-6, atol=1e-6,
                               equal_nan=True)
    lse = kernels.logsumexp(z)
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    grad = kernels.softmax_grad(z, lse, targets, torch.ones(6))
    expected = torch.exp(z.float() - lse[:, None])  # PyTorch's exp of the same differences: NaN for inf - inf
    expected[torch.arange(6), targets] -= 1
    torch.testing.assert_close(grad.float(), expected, rtol=2 ** -7, atol=1e-7, equal_nan=True)


@needs_kernels
def test_bad_arguments_never_reach_the_kernel():
    z = _logits(3, 10)
    lse = kernels.logsumexp(z)
    with pytest.raises(ValueError, match="out of range"):
        kernels.softmax_grad(z, lse, torch.tensor([0, 10, 1]), torch.ones(3))
    with pytest.raises(ValueError, match="3 rows need"):
        kernels.softmax_grad(z, lse, torch.tensor([0, 1]), torch.ones(3))


def test_a_build_without_avx512_is_not_used(plain_build):
    """Without AVX-512 the row sums are sequential plain C: slower than PyTorch's ops, so not used."""
    lib = plain_build("bf16_loss_plain", native_loss)
    assert lib.ce_vectorized() == 0 and native_loss._usable(lib) is None


@needs_kernels
def test_rows_spaced_wider_than_the_vocabulary_and_split_over_threads(monkeypatch):
    """Rows `stride(0)` apart (a slice of wider logits), split across threads in chunks of a few rows."""
    monkeypatch.setattr(native_loss, "MIN_VALUES_PER_THREAD", 64)
    monkeypatch.setattr(native_loss, "CHUNK_VALUES", 300)
    wide = _logits(64, 130)
    z = wide[:, :100]
    assert native_loss.LossKernels.fits(z) and z.stride(0) == 130
    torch.testing.assert_close(kernels.logsumexp(z), torch.logsumexp(z.float(), -1), rtol=1e-6, atol=1e-6)
    targets = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(2))
    grad = kernels.softmax_grad(z, kernels.logsumexp(z), targets, torch.full((64,), 0.5))
    torch.testing.assert_close(grad.float(), _reference_grad(z, targets, torch.full((64,), 0.5)), rtol=2 ** -7,
                               atol=1e-7)


def test_what_the_kernels_take():
    z = _logits(4, 8)
    assert native_loss.LossKernels.fits(z)
    assert not native_loss.LossKernels.fits(z.half())  # fp16: the PyTorch ops
    assert not native_loss.LossKernels.fits(z.t())  # rows not contiguous
    assert not native_loss.LossKernels.fits(z.view(2, 2, 8))


@needs_kernels
def test_loss_with_and_without_the_kernels_agree(monkeypatch):
    z = _logits(32, 700)
    targets = torch.randint(0, 700, (32,), generator=torch.Generator().manual_seed(3))
    targets[::5] = IGNORE_INDEX

    def run():
        x = z.clone().requires_grad_()
        loss = cross_entropy(x, targets)
        loss.backward()
        return loss.detach(), x.grad

    native = run()
    monkeypatch.setattr(native_loss, "kernels", lambda: None)
    ops = run()
    torch.testing.assert_close(native[0], ops[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native[1].float(), ops[1].float(), rtol=2 ** -7, atol=1e-7)


def test_disabled_kernels_leave_the_pytorch_ops(tmp_path):
    code = ("import torch; from minigpt import native_loss; from minigpt.cross_entropy import cross_entropy\n"
            "z = torch.randn(4, 50).bfloat16(); print(native_loss.kernels() is None, float(cross_entropy(z, torch.arange(4))))")
    env = {**os.environ, "MINIQUANT_NATIVE": "0", "MINIQUANT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "True" and list(tmp_path.iterdir()) == []  # nothing built


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 17, 100, 4099])
def test_the_gradient_written_over_the_logits_is_the_same(vocab, monkeypatch):
    """out=logits: every value, the target's too, is read before its gradient overwrites it (threads on rows,
    rows spaced wider than the vocabulary, special rows and rows that do not count)."""
    monkeypatch.setattr(native_loss, "MIN_VALUES_PER_THREAD", 64)
    monkeypatch.setattr(native_loss, "CHUNK_VALUES", 300)
    z = _logits(8, vocab + 3)[:, :vocab]
    z[1, 0] = float("inf")
    z[2, :: 3] = float("-inf")
    targets = torch.tensor([0, vocab - 1, -1, vocab // 2, 0, -1, vocab - 1, vocab // 3])
    lse, scale = kernels.logsumexp(z), torch.linspace(0.5, 2.0, 8)
    fresh = kernels.softmax_grad(z, lse, targets, scale)
    written = kernels.softmax_grad(z, lse, targets, scale, out=z)
    assert written is z
    torch.testing.assert_close(z, fresh, rtol=0, atol=0, equal_nan=True)  # the same bits


@needs_kernels
def test_an_out_that_does_not_fit_is_refused():
    z = _logits(3, 10)
    lse, targets = kernels.logsumexp(z), torch.tensor([0, 1, 2])
    for out in (torch.empty(3, 10), torch.empty(3, 9, dtype=torch.bfloat16), torch.empty(10, 3, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="needs an out"):
            kernels.softmax_grad(z, lse, targets, torch.ones(3), out=out)

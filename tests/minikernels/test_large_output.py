"""minikernels.large_output: a frozen Linear's large output written into fresh huge pages, the same bits and x's
gradient as F.linear's; which products take it; the Linears of minituner.precision that use it."""
import pytest
import torch
import torch.nn.functional as F

from minikernels import fp32_gemm, large_output
from minituner.precision import Bf16Linear, Fp32Linear

# 2,048 tokens × 8,192 outputs in bf16: exactly the 32 MiB from which glibc maps a block of its own
ROWS, IN, OUT = 2048, 64, 8192


def _operands(dtype, bias, batch=()):
    torch.manual_seed(0)
    x = torch.randn(*batch, ROWS, IN).to(dtype).requires_grad_()
    w = (torch.randn(OUT, IN) * 0.1).to(dtype)
    b = torch.randn(OUT).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [(), (1,)])
def test_same_bits_and_input_gradient_as_f_linear(dtype, bias, batch):
    x, w, b = _operands(dtype, bias, batch)
    assert large_output.takes(x, w, b)
    y = large_output.linear(x, w, b)
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, g)
    x_ref = x.detach().requires_grad_()
    y_ref = F.linear(x_ref, w, b)
    (grad_ref,) = torch.autograd.grad(y_ref, x_ref, g)
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert torch.equal(y, y_ref)
    assert torch.equal(grad, grad_ref)


def test_the_output_is_a_fresh_tensor(monkeypatch):
    made = []
    real = large_output.fresh_tensor
    monkeypatch.setattr(large_output, "fresh_tensor", lambda shape, dtype: made.append((shape, dtype)) or
                        real(shape, dtype))
    x, w, _ = _operands(torch.bfloat16, False)
    with torch.no_grad():
        y = large_output.linear(x, w)
    assert made == [((ROWS, OUT), torch.bfloat16)]
    assert y.untyped_storage().nbytes() == large_output.MAPPED_BYTES


def test_which_products_take_it():
    x, w, b = _operands(torch.bfloat16, True)
    assert large_output.output_bytes(x, w) == large_output.MAPPED_BYTES
    assert large_output.takes(x, w, b)
    assert not large_output.takes(x[:-1], w, b)  # one row less: under glibc's threshold, from its heap
    assert not large_output.takes(x, w.float(), b.float())  # x not in the weight's dtype
    assert not large_output.takes(x, w, b.float())
    assert not large_output.takes(x, w.requires_grad_(), b)  # a trainable weight: its gradient is autograd's
    w.requires_grad_(False)
    assert not large_output.takes(x, w, b.requires_grad_())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not large_output.takes(x, w, None)


def _recording(monkeypatch):
    calls = []
    real = large_output.linear
    monkeypatch.setattr(large_output, "linear", lambda *a: calls.append(a) or real(*a))
    return calls


def test_a_bf16_linear_writes_a_large_output_so(monkeypatch):
    calls = _recording(monkeypatch)
    head = Bf16Linear(IN, OUT, bias=False).to(torch.bfloat16).requires_grad_(False)
    x, _, _ = _operands(torch.bfloat16, False, (1,))
    assert torch.equal(head(x), F.linear(x, head.weight))
    assert len(calls) == 1
    head(x[:, :16])  # small: F.linear
    head(x.float())  # fp32 in: cast, as before
    assert len(calls) == 1


@pytest.mark.parametrize("backend, taken", [("aten", True), ("onednn", False)])
def test_an_fp32_linear_writes_a_large_output_so_where_aten_multiplies(monkeypatch, backend, taken):
    calls = _recording(monkeypatch)
    monkeypatch.setattr(fp32_gemm, "backend", lambda: backend)
    head = Fp32Linear(IN, OUT, bias=True).requires_grad_(False)
    x, _, _ = _operands(torch.float32, False)
    y = head(x)
    assert len(calls) == int(taken)
    if taken:
        assert torch.equal(y, F.linear(x, head.weight, head.bias))
    trainable = Fp32Linear(IN, OUT)  # full fine-tuning's: fp32_gemm's Function, for the weight's gradient
    trainable(x)
    assert len(calls) == int(taken)


def _keeping_head() -> Bf16Linear:
    """A bf16 head that keeps its output, as minituner.precision.keep_head_output sets a training run's."""
    head = Bf16Linear(IN, OUT, bias=False).to(torch.bfloat16).requires_grad_(False)
    head.__dict__["_output_store"] = large_output.OutputStore()
    return head


def test_a_head_without_a_store_writes_fresh_pages_every_call():
    head = Bf16Linear(IN, OUT, bias=False).to(torch.bfloat16).requires_grad_(False)
    x, _, _ = _operands(torch.bfloat16, False, (1,))
    with torch.no_grad():
        kept = head(x)  # held: the next call cannot reuse it either way
        assert head(x).data_ptr() != kept.data_ptr()


def _spent_step(head, x):
    """A training step's use of the head: logits, a loss, its backward; nothing of them kept."""
    y = head(x)
    y.float().sum().backward()
    return y.data_ptr()


def test_a_layer_writes_its_spent_output_again(monkeypatch):
    """The step after a step whose logits are spent writes into the same memory, no fresh pages; a smaller output
    takes a prefix of it, a larger one fresh memory, kept from then on."""
    made = []  # fresh tensors (counted, not told apart by address: the old one is freed first, and the fresh
    real = large_output.fresh_tensor  # mapping may land where it was)
    monkeypatch.setattr(large_output, "fresh_tensor", lambda shape, dtype: made.append(shape) or real(shape, dtype))
    head = _keeping_head()
    x, _, _ = _operands(torch.bfloat16, False, (1,))
    first = _spent_step(head, x)
    assert _spent_step(head, x) == first and made == [(ROWS * OUT,)]
    bigger = torch.cat([x, x[:, :64]], dim=1)
    larger = _spent_step(head, bigger)
    assert made == [(ROWS * OUT,), ((ROWS + 64) * OUT,)]
    assert head._output_store.kept_bytes() == (ROWS + 64) * OUT * 2
    assert _spent_step(head, bigger) == larger
    assert _spent_step(head, x) == larger  # a prefix of the larger one
    assert len(made) == 2
    assert torch.equal(head(x), F.linear(x, head.weight))


def _held(y: torch.Tensor, hold: str):
    """(what holds y's memory, a function reading the values it holds back as a tensor)."""
    if hold == "view":
        return y[0, :5], lambda v: v
    if hold == "detach":
        return y.detach(), lambda v: v
    if hold == "data":
        return y.data, lambda v: v
    if hold == "numpy":
        return y.view(torch.int16).numpy(), lambda v: torch.from_numpy(v).view(torch.bfloat16)
    if hold == "storage":
        return y.untyped_storage(), lambda v: torch.empty(0, dtype=y.dtype).set_(v).view(y.shape)
    return y, lambda v: v


@pytest.mark.parametrize("hold", ["output", "view", "detach", "data", "numpy", "storage"])
def test_an_output_still_held_is_never_written_again(hold):
    """Whatever still refers to the last output (the tensor, a view, .detach(), .data, a NumPy array, its storage
    object) keeps its values: the next call writes fresh memory; once that is let go, the memory is taken again."""
    head = _keeping_head()
    x, _, _ = _operands(torch.bfloat16, False, (1,))
    with torch.no_grad():
        y = head(x)
        ptr = y.data_ptr()
        held, read = _held(y, hold)
        expected = read(held).clone()
        del y
        y2 = head(x * 2)
        ptr2 = y2.data_ptr()
        assert ptr2 != ptr
        assert torch.equal(read(held), expected)
        del held, y2
        y3 = head(x)
    assert y3.data_ptr() == ptr2  # the fresh one, kept since and now spent
    assert torch.equal(y3, F.linear(x, head.weight))


def test_a_copied_layer_keeps_no_output():
    import copy
    import pickle

    head = _keeping_head()
    x, _, _ = _operands(torch.bfloat16, False, (1,))
    with torch.no_grad():
        head(x)
    assert head._output_store.kept_bytes() == large_output.MAPPED_BYTES
    for twin in (copy.deepcopy(head), pickle.loads(pickle.dumps(head))):
        assert twin._output_store._kept is None
        assert torch.equal(twin(x.detach()), head(x.detach()))

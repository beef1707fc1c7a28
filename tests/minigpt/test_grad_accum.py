"""Gradient accumulation: a step of several micro-batches is the step of the batch they add up to (every counted
target weighing the same, however the micro-batches pad or mask), resumes bit for bit, and joins a run's identity
only when it accumulates."""
import math

import pytest
import torch

from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import (TrainConfig, adamw, counted_loss, lm_loss, run_identity, train, train_step,
                           without_timing)
from minigpt.train_state import CHECKPOINT_DIR, list_checkpoints

IGNORE = -100
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny(seed: int = 0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8))


def padded_rows(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n examples (x, y) of 8 positions whose last ones are padding (target -100), each counting 1 to 8 targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        x, y = torch.randint(0, 11, (8,), generator=g), torch.randint(0, 11, (8,), generator=g)
        counted = int(torch.randint(1, 9, (1,), generator=g))
        rows.append((x, y.masked_fill(torch.arange(8) >= counted, IGNORE)))
    return rows


def batch(rows) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def test_an_accumulated_step_is_the_step_of_the_whole_batch():
    rows = padded_rows(6, seed=1)
    micro = [batch(rows[:1]), batch(rows[1:4]), batch(rows[4:])]  # 1, 3 and 2 rows, each counting its own targets
    counted = sum(int((y != IGNORE).sum()) for _, y in micro)
    models = [tiny(), tiny()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    params = [list(m.parameters()) for m in models]
    whole, problem = train_step(models[0], opts[0], params[0], [batch(rows)], clip=0.0)
    assert problem is None
    added, problem = train_step(models[1], opts[1], params[1], micro, clip=0.0, loss_fn=counted_loss(counted, 1))
    assert problem is None and torch.isclose(added, whole, atol=1e-6)
    for a, b in zip(*params):
        assert torch.allclose(a, b, atol=1e-6)
    # the mean of each micro-batch's mean loss weighs the one-row micro-batch's tokens more: another step
    naive = tiny()
    opt = torch.optim.SGD(naive.parameters(), lr=0.5)
    opt.zero_grad()
    for x, y in micro:
        (lm_loss(naive, x, y) / len(micro)).backward()
    opt.step()
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params[0], naive.parameters()))


def test_accumulating_needs_a_loss_that_sums_to_the_step():
    model = tiny()
    with pytest.raises(ValueError, match="counted_loss"):
        train_step(model, adamw(list(model.parameters()), 1e-3), list(model.parameters()),
                   [batch(padded_rows(2, 0))] * 2, clip=1.0)


def test_a_non_finite_loss_in_a_later_micro_batch_stops_the_step_before_the_update():
    model = tiny()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    calls = []

    def loss_fn(m, x, y):
        calls.append(1)
        loss = counted_loss(100, 1)(m, x, y)
        return loss if len(calls) == 1 else loss * float("nan")

    reported, problem = train_step(model, adamw(params, 1e-2), params, [batch(padded_rows(2, 0))] * 3, 1.0, loss_fn)
    assert problem.startswith("non-finite loss") and len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def serve(rows):
    """batches(batch_size, generator): the next batch_size rows, in order, round and round (the generator unused)."""
    state = {"i": 0}

    def draw(n: int, g: torch.Generator):
        picked = [rows[(state["i"] + k) % len(rows)] for k in range(n)]
        state["i"] += n
        return batch(picked)

    return draw


def run(tmp_path, batch_size: int, grad_accum: int, steps: int = 3, **kw):
    cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=1e-2, warmup_steps=1,
                      eval_every=steps, **kw)
    model = tiny()
    result = train(model, None, None, cfg, out_dir=tmp_path, progress=False, batches=serve(padded_rows(12, 2)),
                   val_loss=lambda m: 1.0, data_identity={"train_examples_sha256": "t", "val_examples_sha256": "v"},
                   log=lambda *_: None)
    return model, result


def test_train_with_grad_accum_follows_the_run_of_the_batch_it_adds_up_to(tmp_path):
    big_model, big = run(tmp_path / "big", batch_size=4, grad_accum=1)
    model, accumulated = run(tmp_path / "accum", batch_size=2, grad_accum=2)
    for a, b in zip(big.history, accumulated.history):
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-5)
        assert a["lr"] == b["lr"]
    for a, b in zip(big_model.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    # the step's tokens are its micro-batches': tokens/s = 2 x 2 x 8 / step_time_s
    row = accumulated.history[0]
    assert math.isclose(row["tokens_per_s"] * row["step_time_s"], 32, rel_tol=1e-6)


def test_an_accumulating_run_resumes_bit_for_bit(tmp_path):
    whole_model, whole = run(tmp_path / "a", batch_size=2, grad_accum=3, steps=4, checkpoint_every=2)
    out = tmp_path / "b"
    run(out, batch_size=2, grad_accum=3, steps=4, checkpoint_every=2)
    last_step, last = list_checkpoints(out / CHECKPOINT_DIR)[-1]
    assert last_step == 4
    if last.is_dir():
        import shutil
        shutil.rmtree(last)
    else:
        last.unlink()
    cfg = TrainConfig(steps=4, batch_size=2, grad_accum=3, lr=1e-2, warmup_steps=1, eval_every=4, checkpoint_every=2)
    model = tiny(seed=5)  # other weights: the checkpoint's replace them
    served = serve(padded_rows(12, 2))
    served(2 * 3 * 2, None)  # the two steps the checkpoint holds drew these
    resumed = train(model, None, None, cfg, out_dir=out, progress=False, resume=True, batches=served,
                    val_loss=lambda m: 1.0,
                    data_identity={"train_examples_sha256": "t", "val_examples_sha256": "v"}, log=lambda *_: None)
    assert without_timing(resumed.history) == without_timing(whole.history)
    for a, b in zip(whole_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_grad_accum_joins_the_run_identity_only_when_it_accumulates():
    identity = {"train_examples_sha256": "t", "val_examples_sha256": "v"}
    one = run_identity(TrainConfig(), None, None, None, identity)["config"]
    two = run_identity(TrainConfig(grad_accum=2), None, None, None, identity)["config"]
    assert "grad_accum" not in one and two["grad_accum"] == 2  # checkpoints from before the option resume
    with pytest.raises(Exception, match="grad_accum must be >= 1"):
        TrainConfig(grad_accum=0).validate()

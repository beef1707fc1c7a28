"""Resumable training state (minigpt.train_state), the run-folder policy (minigpt.run_dir), and the
training loop's resume and non-finite handling."""
import json
import random
import tempfile
from pathlib import Path

import numpy as np

import pytest
import torch
import torch.nn as nn

import minigpt.train as train_mod
from minigpt.run_dir import check_run_dir
from minigpt.train_state import (CHECKPOINT_DIR, FORMAT, TrainState, capture_rng, from_file, latest_checkpoint,
                                  list_checkpoints, load_checkpoint, restore_rng, save_checkpoint, to_file)
from minigpt.errors import InputError
from minigpt.manifest import seed_everything
from minigpt.model import GPTConfig, MiniGPT
from minigpt.pretrain import pretrain
from minigpt.train import NonFiniteError, TrainConfig, train, without_timing

IDS = torch.randint(0, 37, (3000,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(dropout=0.1) -> MiniGPT:
    seed_everything(0)
    return MiniGPT(GPTConfig(vocab_size=37, block_size=16, n_layer=1, n_head=2, d_model=16, dropout=dropout))


def cfg(steps=12, **kw) -> TrainConfig:
    return TrainConfig(**{"steps": steps, "batch_size": 4, "lr": 1e-2, "warmup_steps": 3, "eval_every": 5,
                          "eval_batches": 2, "checkpoint_every": 4, **kw})


class Interrupt(Exception):
    pass


def interrupt_at(monkeypatch, step):
    """Make the loop die when it asks for the batch of `step` (1-based), as a kill would."""
    calls = {"n": 0}
    original = train_mod.sample_batch

    def sample(*a, **k):
        calls["n"] += 1
        if calls["n"] == step:
            raise Interrupt
        return original(*a, **k)

    monkeypatch.setattr(train_mod, "sample_batch", sample)
    return lambda: monkeypatch.setattr(train_mod, "sample_batch", original)


def test_state_round_trips_through_one_safetensors_file(tmp_path):
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(IDS[:16][None]).sum().backward()
    opt.step()
    random.random(), np.random.rand()
    gen = torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    state = TrainState(7, params, opt.state_dict(), capture_rng(gen), {"val_loss": 1.5, "resumes": []})
    path = save_checkpoint(tmp_path, state, keep=2)
    assert path.name == "step-00000007.safetensors" and path.read_bytes()[8:9] == b"{"  # safetensors header, no pickle
    back = load_checkpoint(path)
    assert back.step == 7 and back.info == state.info and list(back.params) == list(params)
    assert all(torch.equal(back.params[n], p) for n, p in params.items())
    for i, entry in opt.state_dict()["state"].items():
        assert back.optimizer["state"][i].keys() == entry.keys()
        assert all(torch.equal(back.optimizer["state"][i][k], v) for k, v in entry.items())  # step is a tensor too
    assert back.optimizer["param_groups"] == opt.state_dict()["param_groups"]
    expect = (random.random(), float(np.random.rand()), float(torch.rand(())), float(torch.rand((), generator=gen)))
    gen2 = torch.Generator()
    restore_rng(back.rng, gen2)
    again = (random.random(), float(np.random.rand()), float(torch.rand(())), float(torch.rand((), generator=gen2)))
    assert again == expect
    tensors, meta = to_file(back)
    assert meta["format"] == FORMAT and json.loads(meta["state"])["step"] == 7
    with pytest.raises(InputError, match="damaged checkpoint"):
        from_file({k: v for k, v in tensors.items() if k != "rng.torch"}, meta, path)


def test_interrupted_run_resumes_bit_identically_in_process(tmp_path, monkeypatch):
    whole = tiny()
    ref = train(whole, IDS, IDS, cfg(), out_dir=tmp_path / "whole", progress=False)
    cut = tiny()
    restore_batches = interrupt_at(monkeypatch, 11)  # checkpoints at 4 and 8 exist, steps 9 and 10 are lost
    with pytest.raises(Interrupt):
        train(cut, IDS, IDS, cfg(), out_dir=tmp_path / "cut", progress=False)
    restore_batches()
    assert [s for s, _ in list_checkpoints(tmp_path / "cut" / CHECKPOINT_DIR)] == [4, 8]
    fresh = tiny()  # a new process would rebuild the model from its seed before resuming
    res = train(fresh, IDS, IDS, cfg(), out_dir=tmp_path / "cut", progress=False, resume=True, log=lambda *_: None)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), fresh.state_dict().values()))
    assert res.final_val_loss == ref.final_val_loss and without_timing(res.history) == without_timing(ref.history)
    assert metrics(tmp_path / "cut") == metrics(tmp_path / "whole")  # every field but the wall-clock ones
    assert [r["step"] for r in res.resumes] == [8] and len(res.resumes[0]["sha256"]) == 64
    assert [s for s, _ in list_checkpoints(tmp_path / "cut" / CHECKPOINT_DIR)] == [8, 12]  # newest 2 kept


def test_resume_refuses_another_config_or_data_and_allows_new_checkpoint_options(tmp_path):
    train(tiny(), IDS, IDS, cfg(8), out_dir=tmp_path, progress=False)
    with pytest.raises(InputError, match=r"different run \(config.lr 0.01 -> 0.02\)"):
        train(tiny(), IDS, IDS, cfg(8, lr=2e-2), out_dir=tmp_path, progress=False, resume=True)
    with pytest.raises(InputError, match="train_ids_sha256"):
        train(tiny(), IDS.flip(0), IDS, cfg(8), out_dir=tmp_path, progress=False, resume=True)
    with pytest.raises(InputError, match="base_sha256"):
        train(tiny(), IDS, IDS, cfg(8), out_dir=tmp_path, progress=False, resume=True, fingerprint={"base_sha256": "x"})
    res = train(tiny(), IDS, IDS, cfg(8, checkpoint_every=3, skip_nonfinite=True), out_dir=tmp_path, progress=False,
                resume=True, log=lambda *_: None)
    assert res.resumes[0]["step"] == 8 and len(res.history) == 8


def test_damaged_newest_checkpoint_falls_back_and_partial_writes_are_cleaned(tmp_path):
    train(tiny(), IDS, IDS, cfg(8), out_dir=tmp_path, progress=False)
    folder = tmp_path / CHECKPOINT_DIR
    newest = folder / "step-00000008.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # e.g. a disk that lost the end of the file
    (folder / ".tmp-step-00000012.safetensors.abc").write_bytes(b"partial")
    warnings = []
    state, path = latest_checkpoint(folder, warnings.append)
    assert state.step == 4 and path.name == "step-00000004.safetensors"
    assert len(warnings) == 1 and "step-00000008" in warnings[0]
    save_checkpoint(folder, state, keep=5)
    assert not list(folder.glob(".tmp-*"))


def test_check_run_dir(tmp_path):
    check_run_dir(tmp_path / "new", ("manifest.json",))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text("{}")
    with pytest.raises(InputError, match="already holds a run .*--overwrite.*--resume"):
        check_run_dir(tmp_path / "run", ("manifest.json",))
    check_run_dir(tmp_path / "run", ("manifest.json",), overwrite=True)
    with pytest.raises(InputError, match="no checkpoint to resume"):
        check_run_dir(tmp_path / "run", ("manifest.json",), resume=True)
    with pytest.raises(InputError, match="exclude each other"):
        check_run_dir(tmp_path / "run", (), overwrite=True, resume=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a folder"):
        check_run_dir(tmp_path / "file", ())
    with pytest.raises(InputError, match=r"file/a/run: cannot be created, .*file is a file, not a folder"):
        check_run_dir(tmp_path / "file" / "a" / "run", ())  # was an OSError: [Errno 20] Not a directory


def test_check_run_dir_tries_the_folder_it_would_write_in(tmp_path, monkeypatch):
    """A folder that takes no new entries is refused before any work, in one line that says why; the probe leaves
    nothing behind."""
    check_run_dir(tmp_path / "new" / "run", ())
    check_run_dir(tmp_path, ())
    assert list(tmp_path.iterdir()) == []  # the probe folders are gone
    if Path("/proc/self").is_dir():  # Linux: /proc takes no folders, even from root
        with pytest.raises(InputError, match=r"^/proc/minigpt-test/run: cannot be created \(/proc: "):
            check_run_dir(Path("/proc/minigpt-test/run"), ())

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)  # a read-only folder (root is never refused, so mocked)
    with pytest.raises(InputError, match=r"run: cannot be created \(.*: Permission denied\)"):
        check_run_dir(tmp_path / "run", ())
    (tmp_path / "old").mkdir()
    with pytest.raises(InputError, match=r"old: cannot be written \(.*old: Permission denied\)"):
        check_run_dir(tmp_path / "old", ())


class NaNAt(nn.Module):
    """A MiniGPT whose training-mode forward returns NaN logits on the given calls (1-based)."""

    def __init__(self, model: MiniGPT, bad: set[int]) -> None:
        super().__init__()
        self.model, self.config, self.bad, self.calls = model, model.config, bad, 0

    def forward(self, x):
        out = self.model(x)
        if self.training:
            self.calls += 1
            if self.calls in self.bad:
                return out * float("nan")
        return out


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    c = cfg(12, checkpoint_every=3)
    message = r"non-finite loss \(nan\) at step 8; .*step-00000006.safetensors \(step 6\)"
    with pytest.raises(NonFiniteError, match=message):
        train(NaNAt(tiny(), {8}), IDS, IDS, c, out_dir=tmp_path, progress=False)
    folder = tmp_path / CHECKPOINT_DIR
    assert [s for s, _ in list_checkpoints(folder)] == [3, 6]
    assert load_checkpoint(folder / "step-00000006.safetensors").step == 6
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 7  # steps 1..7 recorded, nothing for the bad step
    res = train(NaNAt(tiny(), set()), IDS, IDS, c, out_dir=tmp_path, progress=False, resume=True,
                log=lambda *_: None)
    assert res.resumes[0]["step"] == 6 and len(res.history) == 12


def test_non_finite_gradients_are_caught_even_without_clipping():
    model = tiny(dropout=0.0)
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    model.blocks[0].mlp.fc1.weight.register_hook(poison)
    with pytest.raises(NonFiniteError, match=r"non-finite gradients .* at step 2"):
        train(model, IDS, IDS, cfg(5, checkpoint_every=0, grad_clip=0.0), progress=False)


def test_skip_nonfinite_leaves_weights_and_optimizer_as_they_were():
    c = dict(checkpoint_every=0, schedule="constant", warmup_steps=0, eval_every=100)
    three = tiny()
    train(three, IDS, IDS, cfg(3, **c), progress=False)
    four = tiny()
    res = train(NaNAt(four, {4}), IDS, IDS, cfg(4, skip_nonfinite=True, **c), progress=False)
    assert res.skipped_steps == 1 and res.history[-1]["skipped"].startswith("non-finite loss")
    assert res.history[-1]["train_loss"] is None and res.final_train_loss == res.history[-2]["train_loss"]
    assert all(torch.equal(a, b) for a, b in zip(three.state_dict().values(), four.state_dict().values()))


def test_pretrain_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"line {i} of some text" for i in range(200)))
    c = TrainConfig(steps=10, batch_size=4, eval_every=5, eval_batches=2, seed=7, checkpoint_every=3)
    kw = dict(model_overrides=dict(block_size=16, n_layer=1, n_head=2, d_model=16), progress=False, log=lambda *_: None)
    pretrain(tmp_path / "a", data, train_cfg=c, **kw)
    restore_batches = interrupt_at(monkeypatch, 8)
    with pytest.raises(Interrupt):
        pretrain(tmp_path / "b", data, train_cfg=c, **kw)
    restore_batches()
    with pytest.raises(InputError, match="already holds a run"):
        pretrain(tmp_path / "b", data, train_cfg=c, **kw)
    pretrain(tmp_path / "b", data, train_cfg=c, resume=True, **kw)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [r["step"] for r in manifest["resumes"]] == [6]
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["resumes"] == []


def metrics(folder) -> list[dict]:
    """metrics.jsonl's rows without step_time_s and tokens_per_s (wall-clock: no run repeats them)."""
    return without_timing([json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()])


def test_metrics_rows_carry_step_time_and_tokens_per_second(tmp_path):
    train(tiny(), IDS, IDS, cfg(3, checkpoint_every=0), out_dir=tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_loss_summary():
    from minigpt.train import loss_summary

    rows = [{"step": i + 1, "train_loss": float(10 - i)} for i in range(6)]
    rows[2]["val_loss"] = 4.5
    s = loss_summary(rows, window=2)
    assert (s["steps"], s["first_loss"], s["last_loss"], s["first_mean"], s["last_mean"]) == (6, 10.0, 5.0, 9.5, 5.5)
    assert s["all_finite"] and s["val"] == [(3, 4.5)] and s["mean_window"] == 2
    assert not loss_summary([{"step": 1, "train_loss": float("nan")}], window=1)["all_finite"]

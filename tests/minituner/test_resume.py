"""Crash safety: `minituner finetune` killed with SIGKILL resumes to the same bytes as a run never killed.

Each run is a subprocess started through a small driver that calls the CLI. To kill at a known point the
driver may pause the run (it never changes what the run computes): `step:N` waits when the loop asks for
the batch of step N (steps after the last checkpoint are done and lost), `rename:N` waits between writing
checkpoint N's temporary file and renaming it (a kill in the middle of a checkpoint write).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.train_state import CHECKPOINT_DIR, list_checkpoints, load_checkpoint
from minigpt.data import forecast_documents
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import without_timing
from minigpt.tokenizer import CharTokenizer
from minituner.adapter_io import ADAPTER_FILE
from minituner.cli import main

DRIVER = r'''
import os, sys, time
import torch
torch.set_num_threads(1)
mode, _, arg = sys.argv[1].partition(":")
if mode == "step":
    import minigpt.train as T
    original, calls = T.sample_batch, [0]
    def sample(*a, **k):
        calls[0] += 1
        if calls[0] == int(arg):
            print("PAUSED", flush=True)
            time.sleep(600)
        return original(*a, **k)
    T.sample_batch = sample
elif mode == "rename":
    real_replace = os.replace
    def replace(src, dst):
        if os.path.basename(str(dst)) == "step-%08d.safetensors" % int(arg):
            print("PAUSED", flush=True)
            time.sleep(600)
        return real_replace(src, dst)
    os.replace = replace
from minituner.cli import main
raise SystemExit(main(sys.argv[2:]))
'''
OUTPUTS = (ADAPTER_FILE, "adapter_peft/adapter_model.safetensors", "adapter_peft/adapter_config.json")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    text = "\n\n".join(forecast_documents(300))
    (root / "data.txt").write_text(text, encoding="utf-8")
    tok = CharTokenizer.train(text)
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, d_model=16)), tok,
              root / "base")
    (root / "driver.py").write_text(DRIVER)
    reference = run(root, "plain", root / "ref")
    assert reference.returncode == 0, reference.stderr
    return root


def finetune_args(root, out):
    # dropout on the LoRA path draws from torch's RNG each step: the resume must restore it too
    return ["finetune", "--base", root / "base", "--data", root / "data.txt", "--out", out, "--rank", 2,
            "--alpha", 4, "--dropout", 0.1, "--steps", 40, "--batch-size", 4, "--lr", 1e-2, "--warmup-steps", 4,
            "--eval-every", 10, "--checkpoint-every", 5, "--seed", 3, "--base-domain", "none", "--no-progress"]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(root, mode, out, *extra):
    cmd = [sys.executable, root / "driver.py", mode, *finetune_args(root, out), *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, env=env())


def start_and_kill(root, mode, out, *extra, sig=signal.SIGKILL) -> str:
    """Start a run that pauses at `mode`, wait until it says so, then send it `sig` (SIGKILL); its stderr."""
    cmd = [str(c) for c in (sys.executable, root / "driver.py", mode, *finetune_args(root, out), *extra)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    watchdog = threading.Timer(300, proc.kill)  # a run that never pauses must not hang the test
    watchdog.start()
    try:
        lines = []
        while not lines or lines[-1] != "PAUSED":
            line = proc.stdout.readline()
            assert line, f"the run ended before pausing: {lines} {proc.stderr.read()}"
            lines.append(line.strip())
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
        return proc.stderr.read()
    finally:
        watchdog.cancel()
        proc.stdout.close()
        proc.stderr.close()


def assert_same_outputs(a, b):
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert metrics(a) == metrics(b)  # every field but the wall-clock ones (step_time_s, tokens_per_s)


def metrics(folder) -> list[dict]:
    return without_timing([json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()])


def test_sigkill_between_checkpoints_then_resume_is_bit_identical(setup, tmp_path):
    out = tmp_path / "run"
    start_and_kill(setup, "step:18", out)  # checkpoints 5..15 written, steps 16 and 17 done and lost
    assert [s for s, _ in list_checkpoints(out / CHECKPOINT_DIR)] == [10, 15]
    assert not (out / ADAPTER_FILE).exists() and not (out / "manifest.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 15  # rows after the checkpoint may be lost

    again = run(setup, "plain", out)  # without --resume the folder is refused, untouched
    assert again.returncode == 2 and "--resume" in again.stderr and len(again.stderr.splitlines()) == 1
    assert [s for s, _ in list_checkpoints(out / CHECKPOINT_DIR)] == [10, 15]

    resumed = run(setup, "plain", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_outputs(setup / "ref", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(r["step"], r["checkpoint"]) for r in manifest["resumes"]] == [(15, "checkpoints/step-00000015.safetensors")]
    assert json.loads((setup / "ref" / "manifest.json").read_text())["resumes"] == []
    assert manifest["adapter_sha256"] == json.loads((setup / "ref" / "manifest.json").read_text())["adapter_sha256"]


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(setup, tmp_path):
    out = tmp_path / "run"
    start_and_kill(setup, "rename:10", out)  # checkpoint 10 is written to a temporary file, not yet renamed
    folder = out / CHECKPOINT_DIR
    assert [s for s, _ in list_checkpoints(folder)] == [5]
    assert load_checkpoint(folder / "step-00000005.safetensors").step == 5  # the previous one is whole
    assert [p.name.startswith(".tmp-step-00000010.safetensors") for p in folder.glob(".tmp-*")] == [True]

    resumed = run(setup, "plain", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_outputs(setup / "ref", out)
    assert not list(folder.glob(".tmp-*"))  # the partial file is cleaned up
    assert [r["step"] for r in json.loads((out / "manifest.json").read_text())["resumes"]] == [5]


def test_resuming_a_finished_run_changes_nothing(setup, tmp_path, capsys):
    import shutil

    out = tmp_path / "done"
    shutil.copytree(setup / "ref", out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([str(a) for a in finetune_args(setup, out)] + ["--resume"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert_same_outputs(setup / "ref", out)
    assert "resuming from checkpoints/step-00000040.safetensors: step 40 of 40" in capsys.readouterr().out


def test_a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(setup, tmp_path, capsys):
    out = tmp_path / "diverged"
    lr = ["--lr", "1e14", "--warmup-steps", "1000", "--checkpoint-every", "1", "--steps", "10"]  # later flags win
    assert main([str(a) for a in finetune_args(setup, out)] + lr) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite loss (nan) at step 2" in err, err
    assert "the last good checkpoint is checkpoints/step-00000001.safetensors (step 1)" in err
    assert [s for s, _ in list_checkpoints(out / CHECKPOINT_DIR)] == [1]
    assert not (out / ADAPTER_FILE).exists()


def tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_sigterm_during_an_overwrite_brings_the_earlier_run_back_as_ctrl_c_does(setup, tmp_path):
    """SIGTERM (a scheduler's stop, `kill`) is handled as Ctrl-C: before the first checkpoint the folder is as it
    was; after one, the checkpoint stays for --resume and the message names where the replaced run waits."""
    out = tmp_path / "run"
    shutil.copytree(setup / "ref", out)
    before = tree(out)
    err = start_and_kill(setup, "step:3", out, "--overwrite", sig=signal.SIGTERM)  # before checkpoint 5
    assert err.strip().splitlines()[-1] == "minituner: interrupted (SIGTERM)" and "Traceback" not in err
    assert tree(out) == before and not list(out.glob(".replaced-run.*"))
    err = start_and_kill(setup, "step:8", out, "--overwrite", sig=signal.SIGTERM)  # after checkpoint 5
    (aside,) = out.glob(".replaced-run.*")
    assert f"minituner: interrupted (SIGTERM; the run it replaced waits in {aside})" in err
    assert [s for s, _ in list_checkpoints(out / CHECKPOINT_DIR)] == [5]


def test_a_run_an_overwrite_replaced_is_named_after_a_sigkill_and_goes_once_another_run_stands(setup, tmp_path):
    """SIGKILL before the first checkpoint of an --overwrite run leaves the earlier run in the hidden folder (nothing
    can clean up): --resume names it; the next --overwrite run that succeeds replaces it for good."""
    out = tmp_path / "run"
    shutil.copytree(setup / "ref", out)
    start_and_kill(setup, "step:3", out, "--overwrite")
    (aside,) = out.glob(".replaced-run.*")
    assert (aside / ADAPTER_FILE).read_bytes() == (setup / "ref" / ADAPTER_FILE).read_bytes()
    resumed = run(setup, "plain", out, "--resume")
    assert resumed.returncode == 2 and len(resumed.stderr.strip().splitlines()) == 1
    assert f"replaced waits in {aside}: move its files back to keep it" in resumed.stderr
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    for entry in out.iterdir():  # only the hidden folder left (killed before the new run wrote a file)
        if entry != aside:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    plain = run(setup, "plain", out)  # a new run without --overwrite would delete it on success: refused
    assert plain.returncode == 2 and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
    assert f"in {aside}: move its files back to keep it, or pass --overwrite" in plain.stderr and aside.is_dir()
    again = run(setup, "plain", out, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not list(out.glob(".replaced-run.*")) and (out / ADAPTER_FILE).is_file()

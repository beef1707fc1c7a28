"""The CLI's promise for user mistakes: one line on stderr, exit code 2, no traceback."""
import subprocess
import sys

import pytest


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "minituner", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def assert_one_line_error(r, fragment):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "data.txt"
    data.write_text("\n\n".join(f"hello world {i}" for i in range(300)))
    r = run_cli("pretrain", "--data", str(data), "--out", str(root / "base"), "--steps", "5", "--batch-size", "4",
                "--block-size", "16", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--no-progress")
    assert r.returncode == 0, r.stderr
    return root


def test_pretrain_and_generate(tiny_base):
    r = run_cli("generate", "--base", str(tiny_base / "base"), "--prompt", "hel", "--max-new-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert "sample 1" in r.stdout
    # many samples are drawn SAMPLES_AT_ONCE at a time (memory bounded), numbered on
    r = run_cli("generate", "--base", str(tiny_base / "base"), "--prompt", "hel", "--max-new-tokens", "3",
                "--num-samples", "19", "--temperature", "1e-300")
    assert r.returncode == 0, r.stderr
    headers = [line for line in r.stdout.splitlines() if line.startswith("--- sample")]
    assert headers == [f"--- sample {i} ---" for i in range(1, 20)]
    samples = r.stdout.split("--- sample ")[1:]
    assert len({s.split("---", 1)[1] for s in samples}) == 1  # a temperature that small: greedy, every sample alike
    r = run_cli("generate", "--base", str(tiny_base / "base"), "--prompt", "hel", "--max-new-tokens", "12",
                "--num-samples", "16", "--temperature", "2")
    texts = [s.split("---", 1)[1] for s in r.stdout.split("--- sample ")[1:]]
    assert r.returncode == 0 and len(texts) == 16
    assert texts[8:] != texts[:8] and len(set(texts)) > 8  # the second batch draws on, not from the same seed again


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["pretrain", "--data", "/nonexistent/file.txt", "--out", "{tmp}/o"], "not found"),
        (["pretrain", "--data", "{empty}", "--out", "{tmp}/o"], "empty"),
        (["pretrain", "--n-head", "3", "--out", "{tmp}/o"], "does not divide"),
        (["pretrain", "--block-size", "0", "--out", "{tmp}/o"], "argument --block-size: expected a positive integer, got 0"),
        (["pretrain", "--steps", "zero"], "positive integer"),
        (["generate", "--base", "{tmp}"], "not a model folder"),
        (["generate", "--base", "{tmp}/nope"], "no such model folder"),
        (["frobnicate"], "invalid choice"),
        (["generate", "--base", "{tmp}", "--temperature", "nan"], "--temperature: expected a finite number >= 0"),
        (["generate", "--base", "{tmp}", "--temperature", "-1"], "--temperature: expected a finite number >= 0"),
        (["finetune", "--grad-clip", "-1"], "--grad-clip: expected a finite number >= 0"),
        (["finetune", "--grad-clip", "nan"], "--grad-clip: expected a finite number >= 0"),
        (["finetune", "--warmup-steps", "-1"], "--warmup-steps: expected an integer >= 0"),
    ],
)
def test_bad_input(tmp_path, args, fragment):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [a.format(tmp=tmp_path, empty=empty) for a in args]
    assert_one_line_error(run_cli(*args), fragment)


def test_refuses_to_overwrite_existing_base(tiny_base):
    weights = tiny_base / "base" / "model.safetensors"
    before = weights.read_bytes()
    r = run_cli("pretrain", "--data", str(tiny_base / "data.txt"), "--out", str(tiny_base / "base"))
    assert_one_line_error(r, "--overwrite")
    assert weights.read_bytes() == before

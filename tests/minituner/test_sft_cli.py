"""Instruction data through the commands: `finetune` on each JSONL/JSON shape, `eval`, `generate --chat/--adapter`,
answer-only masking end to end, resume, and bad data refused in one line (exit 2)."""
import json
import shutil

import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.adapter_io import ADAPTER_FILE, load_adapter
from minituner.base_model import load_base
from minituner.sft import SFTConfig, answer, default_template, prepare_eval, prepare_sft

TEMPLATE = default_template()
QUESTIONS = [(f"wind {i}?", f"force {i % 7}") for i in range(30)]
SHAPES = {  # file name -> records (one JSON object per line; .json: one array)
    "text.jsonl": [{"text": f"the wind is force {i % 7} today"} for i in range(30)],
    "pc.jsonl": [{"prompt": q + " ", "completion": a} for q, a in QUESTIONS],
    "chat.jsonl": [{"messages": [{"role": "system", "content": "be short"}, {"role": "user", "content": q},
                                 {"role": "assistant", "content": a}]} for q, a in QUESTIONS],
    "alpaca.json": [{"instruction": "wind?", "input": str(i), "output": f"force {i % 7}"} for i in range(30)],
}
FORMAT = {"text.jsonl": "text", "pc.jsonl": "prompt-completion", "chat.jsonl": "messages", "alpaca.json": "alpaca"}
FLAGS = {"rank": 2, "alpha": 4, "steps": 3, "batch-size": 4, "lr": 0.01, "warmup-steps": 1, "eval-every": 3,
         "checkpoint-every": 0, "base-domain": "none"}


def flags(**changes) -> list[str]:
    """finetune's flags for a tiny run; changes use underscores (eval_every=2) and None drops a flag."""
    chosen = {**FLAGS, **{k.replace("_", "-"): v for k, v in changes.items()}}
    return [a for k, v in chosen.items() if v is not None for a in (f"--{k}", str(v))] + ["--no-progress"]


TRAIN = flags()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def write(path, records):
    if path.suffix == ".json":
        path.write_text(json.dumps(records), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny MiniGPT base (block 48) whose characters cover the data and the default template, and the data."""
    root = tmp_path_factory.mktemp("sft")
    text = json.dumps(SHAPES) + "System: User: Assistant: <|end|>\nthe wind is force today"
    tok = CharTokenizer.train(text)
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=1, n_head=2, d_model=16)), tok,
              root / "base")
    for name, records in SHAPES.items():
        write(root / name, records)
    (root / "plain.txt").write_text("\n\n".join(r["text"] for r in SHAPES["text.jsonl"]), encoding="utf-8")
    return root


@pytest.mark.parametrize("name", list(SHAPES))
def test_finetune_on_each_shape_reports_what_it_counted(root, tmp_path, name, cli):
    out = tmp_path / "run"
    code, stdout, err = cli("finetune", "--base", root / "base", "--data", root / name, "--out", out, *TRAIN)
    assert code == 0, err
    assert (out / ADAPTER_FILE).is_file() and "train: 28 of 28 examples" in stdout  # of 30 records one goes to val, one to test
    sft = json.loads((out / "manifest.json").read_text())["results"]["sft"]
    tok = load_base(root / "base")[1]
    data = prepare_sft(root / name, tok, TEMPLATE, 48)
    assert sft["formats"] == [FORMAT[name]] and sft["template"] == "default" and sft["train_on_inputs"] is False
    assert sft["train"]["counted_tokens"] == data.train_stats.counted_tokens
    assert sft["val"] == data.val_stats.as_dict()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[-1]["val_loss"] > 0


def test_a_hub_style_folder_trains_on_train_and_validates_on_validation(root, tmp_path, cli):
    """data/train-*.parquet and data/validation-*.parquet (a README beside them): the splits their names give."""
    datasets = pytest.importorskip("datasets")
    chats = SHAPES["chat.jsonl"]
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    datasets.Dataset.from_list(chats[:24]).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(chats[24:27]).to_parquet(str(folder / "validation-00000-of-00001.parquet"))
    datasets.Dataset.from_list(chats[27:]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    (tmp_path / "hub" / "README.md").write_text("# dataset card\n")
    out = tmp_path / "run"
    code, stdout, err = cli("finetune", "--base", root / "base", "--data", tmp_path / "hub", "--out", out,
                            *TRAIN)
    assert code == 0, err
    assert "24 train / 3 val examples (messages;" in stdout
    assert "splits as its files name them: train, val, test" in stdout
    sft = json.loads((out / "manifest.json").read_text())["results"]["sft"]
    assert sft["named_splits"] == ["train", "val", "test"] and sft["val"]["examples"] == 3
    code, stdout, err = cli("eval", "--base", root / "base", "--data", tmp_path / "hub", "--split", "test",
                            "--json")
    assert code == 0 and json.loads(stdout)["examples"] == 3, err
    (folder / "train-00000-of-00001.parquet").unlink()
    code, _, err = cli("finetune", "--base", root / "base", "--data", tmp_path / "hub", "--out", out,
                       "--overwrite", *TRAIN)
    assert code == 2 and err.count("\n") == 1
    assert "its files name the val and test splits but no train split" in err
    assert (out / ADAPTER_FILE).is_file()  # the earlier run is still there


def test_eval_counts_the_answers_and_their_eos_only(root, cli):
    tok = load_base(root / "base")[1]
    code, stdout, err = cli("eval", "--base", root / "base", "--data", root / "pc.jsonl", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert list(result) == ["loss", "perplexity", "examples", "tokens"]
    completions = sum(len(tok.encode(a)) + len(tok.encode("<|end|>")) for _, a in QUESTIONS)
    assert result["examples"] == 30 and result["tokens"] == completions
    assert result["perplexity"] == pytest.approx(torch.tensor(result["loss"]).exp().item(), rel=1e-6)
    code, stdout, _ = cli("eval", "--base", root / "base", "--data", root / "pc.jsonl", "--json",
                          "--train-on-inputs", "--split", "val")
    examples, stats = prepare_eval(root / "pc.jsonl", tok, TEMPLATE, 48, SFTConfig(train_on_inputs=True), split="val")
    val = json.loads(stdout)
    assert val["examples"] == len(examples) == 1 and val["tokens"] == stats.counted_tokens == stats.tokens - 1


def test_eval_on_text_counts_every_token_of_its_windows(root, cli):
    code, stdout, err = cli("eval", "--base", root / "base", "--data", root / "plain.txt", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    n = len((root / "plain.txt").read_text())
    assert result["examples"] == (n - 1) // 48 and result["tokens"] == result["examples"] * 48
    code, stdout, _ = cli("eval", "--base", root / "base", "--data", root / "plain.txt")
    assert code == 0 and "perplexity" in stdout


def test_eval_and_generate_with_an_adapter(root, tmp_path, cli):
    out = tmp_path / "run"
    assert cli("finetune", "--base", root / "base", "--data", root / "chat.jsonl", "--out", out, *TRAIN)[0] == 0
    base = json.loads(cli("eval", "--base", root / "base", "--data", root / "chat.jsonl", "--json")[1])
    tuned = json.loads(cli("eval", "--base", root / "base", "--adapter", out, "--data", root / "chat.jsonl",
                           "--json")[1])
    assert tuned["tokens"] == base["tokens"] and tuned["loss"] != base["loss"]
    code, stdout, err = cli("generate", "--base", root / "base", "--adapter", out, "--chat", "wind 3?",
                            "--max-new-tokens", "12")
    assert code == 0, err
    model, tok = load_base(root / "base")
    load_adapter(model, out)
    assert stdout == answer(model, tok, TEMPLATE, "wind 3?", max_new_tokens=12) + "\n"
    code, stdout, err = cli("generate", "--base", root / "base", "--adapter", out / ADAPTER_FILE,
                            "--prompt", "wind", "--max-new-tokens", "5")
    assert code == 0 and stdout.startswith("--- sample 1 ---\nwind"), err


def test_resume_of_an_instruction_run_is_bit_identical(root, tmp_path, cli):
    args = ["finetune", "--base", root / "base", "--data", root / "chat.jsonl",
            *flags(steps=4, checkpoint_every=2, dropout=0.1)]
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    assert cli(*args, "--out", ref)[0] == 0
    shutil.copytree(ref, resumed)
    (resumed / "checkpoints" / "step-00000004.safetensors").unlink()
    assert cli(*args, "--out", resumed, "--resume")[0] == 0
    assert (ref / ADAPTER_FILE).read_bytes() == (resumed / ADAPTER_FILE).read_bytes()
    code, _, err = cli(*args, "--out", resumed, "--resume", "--train-on-inputs")  # other labels: refused
    assert code == 2 and len(err.strip().splitlines()) == 1


BAD = {
    "malformed.jsonl": ('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion"\n', ":2:"),
    "no_assistant.jsonl": ('{"messages": [{"role": "user", "content": "hi"}]}\n', "no assistant turn"),
    "latin1.jsonl": ('{"text": "caf\xe9"}\n'.encode("latin-1"), ":1: not UTF-8"),
    "no_shape.jsonl": ('{"question": "a", "answer": "b"}\n', "fields found: answer, question"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("command", ["finetune", "eval"])
def test_bad_data_is_refused_in_one_line_naming_the_line(root, tmp_path, name, command, cli):
    content, fragment = BAD[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "run"
    argv = [command, "--base", root / "base", "--data", path]
    argv += ["--out", out, *TRAIN] if command == "finetune" else []
    code, _, err = cli(*argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err and name in err, err
    assert not out.exists()


def test_flags_that_do_not_fit_the_data_are_refused(root, tmp_path, cli):
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "plain.txt", "--out",
                       tmp_path / "run", "--format", "messages", *TRAIN)
    assert code == 2 and "--format applies to .jsonl/.json/.parquet/.arrow data" in err
    code, _, err = cli("eval", "--base", root / "base", "--data", root / "pc.jsonl", "--format", "messages")
    assert code == 2 and "pc.jsonl:1" in err
    code, _, err = cli("generate", "--base", root / "base", "--chat", " ")
    assert code == 2 and "--chat is empty" in err


def test_epochs_count_examples(root, tmp_path, cli):
    out = tmp_path / "run"
    argv = flags(steps=None, epochs=0.5)
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "pc.jsonl", "--out", out, *argv)
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["results"]["steps"] == 4  # ceil(0.5 · 28 examples / 4)


def test_grad_accum_steps_count_every_batch_they_add_up(root, tmp_path, capsys, cli):
    out = tmp_path / "run"
    argv = flags(steps=None, epochs=1, grad_accum=2)
    code, stdout, err = cli("finetune", "--base", root / "base", "--data", root / "pc.jsonl", "--out", out,
                            *argv)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["results"]["steps"] == 4  # ceil(1 · 28 examples / (4 x 2))
    assert manifest["config"]["train"]["grad_accum"] == 2
    plan = manifest["results"]["memory_plan"]
    assert plan["grad_accum"] == 2 and "2 of them a step (gradient accumulation)" in stdout
    assert "4 steps of 2 batches of 4 each in fp32" in stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["tokens_per_s"] > 0 for r in rows)
    with pytest.raises(SystemExit) as exit_:
        cli("finetune", "--base", root / "base", "--data", root / "pc.jsonl", "--out", tmp_path / "bad",
            *flags(grad_accum=0))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--grad-accum: expected a positive integer, got 0" in err and err.count("\n") == 1


def test_columns_read_a_data_set_of_other_names(root, tmp_path, cli, capsys):
    data = tmp_path / "qa.jsonl"
    write(data, [{"question": f"wind {i}? ", "answer": f"force {i % 7}"} for i in range(30)])
    out = tmp_path / "run"
    code, stdout, err = cli("finetune", "--base", root / "base", "--data", data, "--out", out,
                            "--columns", "prompt=question,completion=answer", *TRAIN)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["columns"] == {"prompt": "question", "completion": "answer"}
    assert manifest["results"]["sft"]["formats"] == ["prompt-completion"]
    tuned = cli("eval", "--base", root / "base", "--data", data, "--columns", "prompt=question,completion=answer",
                "--json")
    assert tuned[0] == 0 and json.loads(tuned[1])["examples"] == 30, tuned[2]
    code, _, err = cli("finetune", "--base", root / "base", "--data", data, "--out", tmp_path / "bad", *TRAIN)
    assert code == 2 and "qa.jsonl:1: fields found: answer, question" in err
    with pytest.raises(SystemExit) as exit_:
        cli("finetune", "--base", root / "base", "--data", data, "--out", tmp_path / "bad", "--columns", "ask=question")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'ask' is not a field the shapes read" in err and err.count("\n") == 1
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "plain.txt", "--out", tmp_path / "bad",
                       "--columns", "text=body", *TRAIN)
    assert code == 2 and "--columns applies to .jsonl/.json/.parquet/.arrow data" in err


def test_a_cards_config_and_its_splits_through_finetune_and_eval(root, tmp_path, cli):
    """A snapshot whose card declares two configs with splits named train_sft and test_sft: --data-config and
    --data-split choose what finetune trains and validates on, the run records both, eval reads the same."""
    chats = SHAPES["chat.jsonl"]
    snap = tmp_path / "snap"
    for config, rows in (("short", chats[:20]), ("long", chats[20:])):
        (snap / config).mkdir(parents=True)
        write(snap / config / "train_sft.jsonl", rows[:-4])
        write(snap / config / "test_sft.jsonl", rows[-4:])
    (snap / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train_sft\n    path: {c}/train_sft.jsonl\n"
        f"  - split: test_sft\n    path: {c}/test_sft.jsonl\n" for c in ("short", "long")) + "---\n")
    out = tmp_path / "run"
    choose = ("--data-config", "short", "--data-split", "train=train_sft,val=test_sft")
    code, stdout, err = cli("finetune", "--base", root / "base", "--data", snap, "--out", out, *choose, *TRAIN)
    assert code == 0, err
    assert ("16 train / 4 val examples (messages;" in stdout and "splits as config 'short' of its dataset card names "
            "them: train, val (--data-split train=train_sft,val=test_sft)" in stdout), stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["data_config"] == "short"
    assert manifest["config"]["data_splits"] == {"train": "train_sft", "val": "test_sft"}
    assert manifest["results"]["sft"]["data_config"] == "short" and manifest["results"]["sft"]["val"]["examples"] == 4
    code, stdout, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", snap, *choose, "--split",
                            "val", "--json")
    assert code == 0 and json.loads(stdout)["loss"] == pytest.approx(manifest["results"]["val_loss_after"]), err
    assert "its run's" not in err
    # the flags not given: the run's, for the data it trained on (the card alone names no config to read)
    code, stdout, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", snap, "--split", "val",
                            "--json")
    assert code == 0 and json.loads(stdout)["loss"] == pytest.approx(manifest["results"]["val_loss_after"]), err
    assert f"eval: reading {snap} with its run's --data-config, --data-split (as it trained on it)" in err
    code, stdout, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", snap, "--split", "val",
                            "--data-config", "long", "--json")  # a flag given wins; the splits still the run's
    assert code == 0 and "with its run's --data-split (" in err, err
    long = json.loads(stdout)
    assert long["examples"] == 4 and long["loss"] != pytest.approx(manifest["results"]["val_loss_after"])
    copy = tmp_path / "copy"  # other data: the flags' own defaults
    shutil.copytree(snap, copy)
    code, _, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", copy, "--split", "val")
    assert code == 2 and "declares the configs short, long" in err
    code, _, err = cli("finetune", "--base", root / "base", "--data", snap, "--out", out, "--overwrite", *TRAIN)
    assert code == 2 and err.count("\n") == 1 and "declares the configs short, long" in err
    assert (out / ADAPTER_FILE).is_file()  # the earlier run is still there
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "plain.txt", "--out", tmp_path / "bad",
                       "--data-config", "short", *TRAIN)
    assert code == 2 and "--data-config applies to .jsonl/.json/.parquet/.arrow data" in err


def test_eval_reads_the_runs_own_data_as_it_trained(root, tmp_path, cli):
    """--format, --train-on-inputs and --overlong not given to eval are the run's for its own data, so
    `eval --adapter RUN --split val` is the run's val_loss_after; given, they win; other data: the defaults."""
    both = write(tmp_path / "both.jsonl", [{"text": f"the wind is force {i % 7} today", "prompt": q + " ",
                                            "completion": a} for i, (q, a) in enumerate(QUESTIONS)])
    for run_flags, said in ((["--train-on-inputs"], "--train-on-inputs"), (["--format", "text"], "--format text"),
                            (["--overlong", "drop", "--train-on-inputs"], "--train-on-inputs, --overlong drop")):
        out = tmp_path / "run"
        code, _, err = cli("finetune", "--base", root / "base", "--data", both, "--out", out, "--overwrite",
                           *run_flags, *TRAIN)
        assert code == 0, err
        val_loss = json.loads((out / "manifest.json").read_text())["results"]["val_loss_after"]
        code, stdout, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", both, "--split", "val",
                                "--json")
        assert code == 0 and json.loads(stdout)["loss"] == pytest.approx(val_loss, rel=1e-6), (run_flags, err)
        assert f"eval: reading {both} with its run's {said} (as it trained on it)" in err
        code, stdout, err = cli("eval", "--base", root / "base", "--adapter", out, "--data", both, "--split", "val",
                                "--format", "prompt-completion", "--no-train-on-inputs", "--overlong", "truncate",
                                "--json")  # every flag given: the run's are not taken
        assert code == 0 and "its run's" not in err
        assert json.loads(stdout)["loss"] != pytest.approx(val_loss, rel=1e-6)
    shutil.copy(both, tmp_path / "other.jsonl")  # the same records in another file: not the run's data
    code, stdout, err = cli("eval", "--base", root / "base", "--adapter", tmp_path / "run", "--data",
                            tmp_path / "other.jsonl", "--split", "val", "--json")
    assert code == 0 and "its run's" not in err

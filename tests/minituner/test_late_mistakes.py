"""User mistakes found late (during a run, in a template, a checkpoint or a flag's range): one line on stderr, exit
code 2, no traceback, and nothing already on disk lost: a failed run leaves its folder as it was, export never
replaces the folders it reads."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from minituner.cli import main  # noqa: E402

TRAIN = ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--rank", "4", "--base-domain", "none",
         "--no-progress"]


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys, code, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    return err


def copy_with(base: Path, folder: Path, config: dict | None = None, tensor: tuple[str, float] | None = None) -> Path:
    """A copy of a base folder with config.json entries changed, or one tensor filled with a value."""
    shutil.copytree(base, folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensor:
        weights = load_file(folder / "model.safetensors")
        weights[tensor[0]].fill_(tensor[1])
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_export_never_replaces_the_base_the_run_or_the_current_folder(hf_folder, data, tmp_path, capsys,
                                                                      monkeypatch):
    base = hf_folder("llama")
    home = tmp_path / "project"
    shutil.copytree(base, home / "base")
    assert main(["finetune", "--base", str(home / "base"), "--data", str(data), "--out", str(home / "run"),
                 *TRAIN]) == 0
    (home / "notes.txt").write_text("mine")
    capsys.readouterr()
    before = hashes(home)
    for out in (home, home / "base", home / "run"):
        code = main(["export", "--base", str(home / "base"), "--adapter", str(home / "run"), "--out", str(out),
                     "--overwrite"])
        one_line_error(capsys, code, "which writing it would replace")
    (home / "elsewhere").mkdir()
    monkeypatch.chdir(home / "elsewhere")
    code = main(["export", "--base", str(home / "base"), "--adapter", str(home / "run"), "--out", ".",
                 "--overwrite"])
    one_line_error(capsys, code, "the current folder")
    assert hashes(home) == before


def test_a_run_that_fails_leaves_its_folder_as_it_was(hf_folder, data, tmp_path, capsys):
    base = hf_folder("llama")
    nan_base = copy_with(base, tmp_path / "nan-base", tensor=("lm_head.weight", float("nan")))
    run = tmp_path / "run"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(run), *TRAIN,
                 "--checkpoint-every", "1"]) == 0
    (run / "notes.txt").write_text("mine")
    capsys.readouterr()
    before = hashes(run)
    code = main(["finetune", "--base", str(nan_base), "--data", str(data), "--out", str(run), *TRAIN, "--overwrite"])
    one_line_error(capsys, code, "nan")
    assert hashes(run) == before and not list(run.glob(".replaced-run.*"))  # the earlier run, whole
    fresh = tmp_path / "fresh"
    code = main(["finetune", "--base", str(nan_base), "--data", str(data), "--out", str(fresh), *TRAIN])
    one_line_error(capsys, code, "nan")
    assert not fresh.exists()  # nothing left that would refuse the next try
    # a nan at a later step keeps the checkpoint the error names, for --resume --skip-nonfinite
    late = tmp_path / "late"
    code = main(["finetune", "--base", str(base), "--data", str(data), "--out", str(late), *TRAIN, "--steps", "3",
                 "--checkpoint-every", "1", "--lr", "1e30"])
    one_line_error(capsys, code, "the last good checkpoint is checkpoints/step-00000001.safetensors")
    assert (late / "checkpoints" / "step-00000001.safetensors").is_file()
    # a folder of the user's own files (no run in it): a failed run removes only what it wrote
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text("{}")
    code = main(["finetune", "--base", str(nan_base), "--data", str(data), "--out", str(own), *TRAIN])
    one_line_error(capsys, code, "nan")
    assert sorted(p.name for p in own.iterdir()) == ["config.json"]
    # and a run that succeeds over an earlier one replaces it
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(run), *TRAIN, "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "mine" and not list(run.glob(".replaced-run.*"))


@pytest.mark.parametrize("template,needle", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ 'a' + 1 }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% if false %}x{% endif %}", "renders the question as no text"),
])
def test_a_chat_template_that_fails_is_one_line(hf_folder, tmp_path, capsys, template, needle):
    base = tmp_path / "base"
    shutil.copytree(hf_folder("llama"), base)
    (base / "chat_template.jinja").write_text(template)
    capsys.readouterr()
    one_line_error(capsys, main(["generate", "--base", str(base), "--chat", "hello"]), needle)


def test_nan_weights_and_config_numbers_that_make_nan(hf_folder, data, tmp_path, capsys):
    base = hf_folder("llama")
    nan = copy_with(base, tmp_path / "nan", tensor=("lm_head.weight", float("nan")))
    capsys.readouterr()  # what building the fixture printed
    one_line_error(capsys, main(["generate", "--base", str(nan), "--prompt", "hello"]), "lm_head.weight holds nan")
    one_line_error(capsys, main(["generate", "--base", str(nan), "--prompt", "hello", "--temperature", "0"]),
                   "lm_head.weight holds nan or inf")
    one_line_error(capsys, main(["eval", "--base", str(nan), "--data", str(data)]), "lm_head.weight holds nan")
    # a nan in a query weight: PyTorch's CPU attention gives zeros for a nan query, so the logits stay finite
    q_nan = copy_with(base, tmp_path / "q-nan", tensor=("model.layers.0.self_attn.q_proj.weight", float("nan")))
    one_line_error(capsys, main(["generate", "--base", str(q_nan), "--prompt", "hello"]),
                   "model.layers.0.self_attn.q_proj.weight holds nan or inf")
    # a rope theta so small that the rotary frequencies overflow
    tiny_theta = copy_with(base, tmp_path / "tiny-theta",
                           config={"rope_parameters": {"rope_theta": 1e-300, "rope_type": "default"}})
    one_line_error(capsys, main(["generate", "--base", str(tiny_theta), "--prompt", "hello"]),
                   "rope_theta 1e-300 makes the rotary angles overflow")
    for i, (config, needle) in enumerate([({"rms_norm_eps": 0}, "norm_eps must be a positive finite number"),
                                          ({"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}},
                                           "rope_theta must be a positive finite number"),
                                          ({"hidden_act": ["silu"]}, "hidden_act ['silu'] is not supported"),
                                          ({"model_type": ["llama"]}, "model_type ['llama'] is not supported")]):
        folder = copy_with(base, tmp_path / f"config{i}", config=config)
        one_line_error(capsys, main(["generate", "--base", str(folder), "--prompt", "hello"]), needle)


def _metadata(path: Path) -> dict:
    with open(path, "rb") as f:  # a safetensors file's metadata as written
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]


def test_a_damaged_checkpoint_is_named_on_resume(hf_folder, data, tmp_path, capsys):
    base = hf_folder("llama")
    run = tmp_path / "run"
    args = ["finetune", "--base", str(base), "--data", str(data), "--out", str(run), *TRAIN, "--checkpoint-every", "1"]
    assert main(args) == 0
    capsys.readouterr()
    newest = sorted((run / "checkpoints").iterdir())[-1]
    tensors = load_file(newest)
    with open(newest, "rb") as f:  # the metadata (info, RNG states) as written
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    metadata = header["__metadata__"]
    state = json.loads(metadata["state"])
    for info in ({k: v for k, v in state["info"].items() if k != "elapsed_s"}, {**state["info"], "val_loss": "low"}):
        save_file(tensors, newest, metadata={**metadata, "state": json.dumps({**state, "info": info})})
        one_line_error(capsys, main([*args, "--resume"]), "damaged checkpoint info")
    save_file(tensors, newest, metadata={**metadata, "state": json.dumps({**state, "step": 10**6})})
    one_line_error(capsys, main([*args, "--resume"]), "outside this run's 1..2")
    # nan in a parameter or an optimizer moment: damaged, skipped like a truncated file, the one before resumed
    for part in ("param.", "optim."):
        nan = {k: (torch.full_like(v, float("nan")) if k.startswith(part) and v.is_floating_point() else v)
               for k, v in tensors.items()}
        save_file(nan, newest, metadata=metadata)
        assert main([*args, "--resume"]) == 0
        out, err = capsys.readouterr()
        assert f"warning: skipping {newest}: " in out + err and "holds nan or inf" in out + err
        assert f"resuming from checkpoints/{sorted((run / 'checkpoints').iterdir())[0].name}" in out + err
        save_file(nan, newest, metadata=metadata)  # (the resumed run wrote it afresh)
        for older in sorted((run / "checkpoints").iterdir())[:-1]:
            older.unlink()
        one_line_error(capsys, main([*args, "--resume"]), "no checkpoint to resume from (every one is damaged)")
        assert main(args[:-2] + ["--checkpoint-every", "1", "--overwrite"]) == 0  # two checkpoints again
        capsys.readouterr()
        newest = sorted((run / "checkpoints").iterdir())[-1]
        tensors, metadata = load_file(newest), _metadata(newest)


@pytest.mark.parametrize("flag,value", [("--seed", str(2**70)), ("--lr", "1e39")])
def test_numbers_beyond_what_torch_holds_are_refused_by_the_parser(hf_folder, data, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["finetune", "--base", str(hf_folder("llama")), "--data", str(data), "--out", str(tmp_path / "run"),
              *TRAIN, flag, value])
    assert exit_.value.code == 2 and "error: argument " + flag in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_text_that_is_not_unicode_is_named(hf_folder, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "the \ud800", "completion": "wind"}, ensure_ascii=True) + "\n")
    base = hf_folder("llama")
    capsys.readouterr()
    one_line_error(capsys, main(["eval", "--base", str(base), "--data", str(path)]), "d.jsonl:1: a string holds")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    one_line_error(capsys, main(["eval", "--base", str(base), "--data", str(deep)]), "nested too deeply")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--base", str(base), "--prompt", "the \udcff"])
    assert exit_.value.code == 2 and "not UTF-8 text" in capsys.readouterr().err


def test_a_sparse_vocabulary_past_the_embedding_is_refused(hf_folder, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(hf_folder("llama"), base)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab[next(iter(w for w in vocab if w not in ("[UNK]", "<s>", "</s>")))] = 500  # one id far past 40 rows
    (base / "tokenizer.json").write_text(json.dumps(tokenizer))
    capsys.readouterr()
    one_line_error(capsys, main(["generate", "--base", str(base), "--prompt", "hello"]), "ids up to 500")


@pytest.mark.parametrize("failure", [RuntimeError("DefaultCPUAllocator: can't allocate memory"), MemoryError(),
                                     OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_any_failure_before_a_checkpoint_brings_the_earlier_run_back(tmp_path, failure):
    from minigpt.run_dir import replacing_run
    from minituner.finetune import LORA_RUN_FILES, RUN_MARKERS

    out = tmp_path / "run"
    out.mkdir()
    for name, text in (("manifest.json", "{}"), ("metrics.jsonl", "old"), ("notes.txt", "mine")):
        (out / name).write_text(text)
    before = hashes(out)
    with pytest.raises(type(failure)):
        with replacing_run(out, LORA_RUN_FILES, RUN_MARKERS):
            (out / "metrics.jsonl").write_text("new")
            (out / "loss_curve.png").write_text("new")
            raise failure
    assert hashes(out) == before and not list(out.glob(".replaced-run.*"))


def test_a_resumed_replacement_deletes_the_run_it_replaced_once_it_succeeds(tmp_path):
    from minigpt.run_dir import replacing_run
    from minituner.finetune import LORA_RUN_FILES, RUN_MARKERS

    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):  # killed after a checkpoint: both stay
        with replacing_run(out, LORA_RUN_FILES, RUN_MARKERS):
            (out / "checkpoints").mkdir()
            (out / "checkpoints" / "step-00000001.safetensors").write_text("new")
            raise KeyboardInterrupt
    (aside,) = out.glob(".replaced-run.*")
    assert (aside / "manifest.json").read_text() == "old"
    with pytest.raises(FloatingPointError):  # a resume that fails keeps it
        with replacing_run(out, LORA_RUN_FILES, RUN_MARKERS, resuming=True):
            raise FloatingPointError("nan")
    assert aside.is_dir()
    with replacing_run(out, LORA_RUN_FILES, RUN_MARKERS, resuming=True):
        (out / "manifest.json").write_text("new")
    assert not aside.exists() and (out / "manifest.json").read_text() == "new"


def test_overwrite_refuses_inputs_among_the_files_of_the_run_it_replaces(hf_folder, data, tmp_path, capsys):
    """--overwrite moves the earlier run aside before reading anything: an input from it would read as missing."""
    base, run = hf_folder("llama"), tmp_path / "run"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(run), *TRAIN]) == 0
    capsys.readouterr()
    before = hashes(run)
    for flag, path in (("--init-adapter", run / "adapter_final.safetensors"), ("--init-adapter", run),
                       ("--init-adapter", run / "adapter_peft"), ("--data", run / "metrics.jsonl"),
                       ("--base-domain", run / "checkpoints")):
        extra = [flag, str(path)] if flag != "--data" else []
        data_path = path if flag == "--data" else data
        code = main(["finetune", "--base", str(base), "--data", str(data_path), "--out", str(run), *TRAIN,
                     "--overwrite", *extra])
        one_line_error(capsys, code, f"{flag} {path} reads the run in {run} that --overwrite replaces")
    assert hashes(run) == before
    (run / "mine.txt").write_text(data.read_text())  # the user's own file beside the run is not the run's
    assert main(["finetune", "--base", str(base), "--data", str(run / "mine.txt"), "--out", str(run), *TRAIN,
                 "--overwrite"]) == 0


@pytest.mark.parametrize("written", ["adapter_peft", "loss_curve.png", "chat_template.jinja"])
def test_a_folder_holding_any_file_a_run_writes_is_refused(hf_folder, data, tmp_path, capsys, written):
    base, out = hf_folder("llama"), tmp_path / "out"
    out.mkdir()
    (out / written).mkdir() if written == "adapter_peft" else (out / written).write_text("mine")
    before = hashes(out)
    code = main(["finetune", "--base", str(base), "--data", str(data), "--out", str(out), *TRAIN])
    one_line_error(capsys, code, f"already holds a run ({written})")
    assert hashes(out) == before and sorted(p.name for p in out.iterdir()) == [written]


def test_a_pretrain_overwrite_that_fails_leaves_the_base_as_it_was(data, tmp_path, capsys):
    out = tmp_path / "base"
    tiny = ["--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2", "--block-size", "8",
            "--n-layer", "1", "--n-head", "1", "--d-model", "8", "--no-progress"]
    assert main(["pretrain", *tiny]) == 0 and list((out / "checkpoints").iterdir())
    capsys.readouterr()
    before = hashes(out)
    one_line_error(capsys, main(["pretrain", *tiny, "--overwrite", "--lr", "1e30"]), "non-finite loss")
    assert hashes(out) == before and not list(out.glob(".replaced-run.*"))
    assert main(["pretrain", *tiny, "--overwrite", "--seed", "5"]) == 0  # a run that succeeds replaces it
    assert hashes(out) != before and not list(out.glob(".replaced-run.*"))
    # a finetune run's folder: pretrain would leave its adapter beside the new base, so it is refused
    run = tmp_path / "run"
    assert main(["finetune", "--base", str(out), "--data", str(data), "--out", str(run), *TRAIN]) == 0
    capsys.readouterr()
    before = hashes(run)
    one_line_error(capsys, main(["pretrain", *tiny[:2], "--out", str(run), *tiny[4:], "--overwrite"]),
                   f"{run} holds a finetune run (adapter_final.safetensors); pretrain --overwrite replaces only")
    assert hashes(run) == before
    full = tmp_path / "full"  # a full fine-tune's folder is a base folder too: its manifest says whose
    assert main(["finetune", "--base", str(out), "--data", str(data), "--out", str(full), *TRAIN, "--full"]) == 0
    capsys.readouterr()
    before = hashes(full)
    one_line_error(capsys, main(["pretrain", *tiny[:2], "--out", str(full), *tiny[4:], "--overwrite"]),
                   f"{full} holds a finetune run (manifest.json)")
    assert hashes(full) == before


@pytest.mark.parametrize("edit", [("seq_len", "eight", "records seq_len 'eight', not a positive integer"),
                                  ("seq_len", 0, "records seq_len 0, not a positive integer"),
                                  ("precision", "fp8", "records precision 'fp8'; valid: fp32, bf16")])
def test_eval_refuses_an_edited_run_manifest_it_would_have_ignored(hf_folder, data, tmp_path, capsys, edit):
    base, run = hf_folder("llama"), tmp_path / "run"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(run), *TRAIN]) == 0
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    key, value, needle = edit
    (manifest["config"] if key == "seq_len" else manifest["config"]["train"])[key] = value
    path.write_text(json.dumps(manifest))
    capsys.readouterr()
    one_line_error(capsys, main(["eval", "--base", str(base), "--adapter", str(run), "--data", str(data)]), needle)


def test_a_data_folder_holding_a_run_or_a_model_is_refused(hf_folder, data, tmp_path, capsys):
    """A run written inside its data folder (or a model kept there) would be read back as data by the next run,
    recursively: its metrics.jsonl, manifest.json, a tokenizer's merges.txt. Refused in one line, nothing written."""
    base = hf_folder("llama")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(data, corpus / "words.txt")
    assert main(["finetune", "--base", str(base), "--data", str(corpus), "--out", str(corpus / "run1"), *TRAIN]) == 0
    capsys.readouterr()
    before = hashes(tmp_path)
    code = main(["finetune", "--base", str(base), "--data", str(corpus), "--out", str(tmp_path / "run2"), *TRAIN])
    one_line_error(capsys, code, "run1 holds a model or a training run (manifest.json, metrics.jsonl)")
    code = main(["pretrain", "--data", str(corpus), "--out", str(tmp_path / "base2"), "--steps", "1"])
    one_line_error(capsys, code, "run1 holds a model or a training run")
    shutil.rmtree(corpus / "run1")
    shutil.copytree(base, corpus / "models" / "llama")  # a Hugging Face model folder kept beside the text
    one_line_error(capsys, main(["pretrain", "--data", str(corpus), "--out", str(tmp_path / "base2"), "--steps", "1"]),
                   "models/llama holds a model or a training run (config.json, model.safetensors)")
    chat = tmp_path / "chat"
    (chat / "adapter").mkdir(parents=True)
    (chat / "train.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (chat / "adapter" / name).write_text("{}")
    code = main(["finetune", "--base", str(base), "--data", str(chat), "--out", str(tmp_path / "run3"), *TRAIN])
    one_line_error(capsys, code, "adapter holds a model or a training run (adapter_config.json")
    assert not (tmp_path / "run2").exists() and not (tmp_path / "base2").exists() and not (tmp_path / "run3").exists()
    assert all(hashes(tmp_path)[k] == v for k, v in before.items() if not k.startswith("corpus/run1"))


def test_a_training_checkpoint_given_as_an_adapter_is_named_as_one(hf_folder, data, tmp_path, capsys):
    """eval said 'the file records no LoRA config (r, alpha); pass one' (a flag it has not), finetune
    --init-adapter listed the optimizer's keys (optim.0.exp_avg, ...) as unexpected."""
    base = hf_folder("llama")
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "run"), *TRAIN,
                 "--checkpoint-every", "1"]) == 0
    capsys.readouterr()
    checkpoint = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    for argv in (["eval", "--base", str(base), "--data", str(data), "--adapter", str(checkpoint)],
                 ["finetune", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "next"), *TRAIN,
                  "--init-adapter", str(checkpoint)]):
        one_line_error(capsys, main(argv), "a training checkpoint (the trained tensors with the optimizer's state)")
    assert not (tmp_path / "next").exists()


def test_init_adapter_with_another_scaling_and_an_adapter_of_another_rank_are_refused(hf_folder, data, tmp_path,
                                                                                       capsys):
    """--init-adapter starts from the adapter as trained: another --alpha, --rank or --use-rslora would scale its
    update otherwise, and is refused naming the adapter's value; a config whose r is not its tensors' is damaged."""
    base, first = hf_folder("llama"), tmp_path / "first"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(first), *TRAIN, "--alpha",
                 "4"]) == 0
    capsys.readouterr()
    start = ["finetune", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "second"), *TRAIN,
             "--init-adapter"]
    for source in (first, first / "adapter_peft"):
        one_line_error(capsys, main([*start, str(source)]), "this run's alpha 16.0 (the adapter's 4.0) would scale")
        one_line_error(capsys, main([*start, str(source), "--alpha", "4", "--use-rslora"]),
                       "use_rslora True (the adapter's False)")
    assert not (tmp_path / "second").exists()
    assert main([*start, str(first), "--alpha", "4"]) == 0
    capsys.readouterr()
    config = first / "adapter_peft" / "adapter_config.json"
    rank = json.loads(config.read_text())["r"]
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": rank * 2}))
    one_line_error(capsys, main(["generate", "--base", str(base), "--adapter", str(first / "adapter_peft"),
                                 "--prompt", "hi"]), f"damaged adapter: its config records r {rank * 2}")

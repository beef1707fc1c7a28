"""minituner.finetune and the `minituner finetune` command on a tiny base."""
import json

import pytest
import torch

from minigpt.base_folder import save_base
from minituner.base_model import load_base
from minigpt.data import forecast_documents
from minigpt.errors import InputError
from minigpt.io import sha256_file
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minigpt.train import TrainConfig, train
from minituner.adapter_io import ADAPTER_FILE, load_adapter
from minituner.cli import main
from minituner.finetune import FinetuneConfig, finetune, steps_for_epochs
from minituner.lora import LoRAConfig, lora_modules


DOCS = "\n\n".join(f"The function f{i}(x) returns x plus {i}." for i in range(60))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and do not fight other test processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_base(folder, d_model=16, seed=0, pretrain_steps=0):
    """A tiny base folder; with pretrain_steps it first learns DOCS (a random base's frozen, tiny-norm
    embedding caps what LoRA alone can reach)."""
    tok = CharTokenizer.train("\n\n".join(forecast_documents(200)) + DOCS)
    torch.manual_seed(seed)
    model = MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, d_model=d_model))
    if pretrain_steps:
        ids = torch.tensor(tok.encode(DOCS))
        train(model, ids, ids, quick(pretrain_steps, eval_every=pretrain_steps), progress=False)
    save_base(model, tok, folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("base"), pretrain_steps=60)


@pytest.fixture(scope="module")
def other_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.txt"
    path.write_text(DOCS, encoding="utf-8")
    return path


def quick(steps=30, **kw) -> TrainConfig:
    return TrainConfig(**{"steps": steps, "batch_size": 8, "lr": 1e-2, "warmup_steps": 3, "eval_every": 10,
                          "eval_batches": 4, **kw})


def test_lora_finetune_writes_a_run_and_improves_val_loss(base, other_text, tmp_path):
    base_sha = sha256_file(base / "model.safetensors")
    cfg = FinetuneConfig(lora=LoRAConfig(r=4, alpha=8), train=quick(60), base_domain=str(other_text))
    res = finetune(base, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    run = tmp_path / "run"
    for name in (ADAPTER_FILE, "adapter_peft/adapter_config.json", "adapter_peft/adapter_model.safetensors",
                 "metrics.jsonl", "loss_curve.png", "manifest.json"):
        assert (run / name).is_file(), name
    s = res.summary
    assert s["val_loss_after"] < s["val_loss_before"] - 0.2
    assert s["params_trainable"] == sum(p.numel() for p in res.model.parameters() if p.requires_grad)
    assert 0 < s["trainable_fraction"] < 0.5 and s["artifact_bytes"] < s["base_bytes"]
    assert s["base_domain_val_loss_before"] > 0 and s["base_domain_val_loss_after"] > 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["base_sha256"] == base_sha == sha256_file(base / "model.safetensors")  # base untouched
    assert manifest["adapter_sha256"] == sha256_file(run / ADAPTER_FILE)
    assert manifest["config"]["lora"]["r"] == 4 and manifest["results"]["steps"] == 60
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and "val_loss" in rows[-1]
    reloaded, _ = load_base(base)
    load_adapter(reloaded, run / ADAPTER_FILE)
    x = torch.randint(0, reloaded.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    res.model.eval()
    assert torch.equal(reloaded(x), res.model(x))
    peft_copy, _ = load_base(base)
    load_adapter(peft_copy, run / "adapter_peft")
    assert torch.equal(peft_copy(x), res.model(x))



def test_a_base_domain_the_tokenizer_cannot_read_is_named_in_the_log_and_the_manifest(base, other_text, tmp_path):
    """The forgetting check's loss on text mostly <unk> to the base tokenizer (a word-level vocabulary on Python's
    docs read 92% <unk>) looked like a fine base-domain loss; now its unknown fraction is recorded and said."""
    greek = tmp_path / "greek.txt"
    greek.write_text("\n\n".join(f"Η συνάρτηση f{i}(x) επιστρέφει x συν {i}." for i in range(60)),
                     encoding="utf-8")
    for domain, unknown in ((greek, True), (other_text, False)):
        lines = []
        cfg = FinetuneConfig(lora=LoRAConfig(r=4, alpha=8), train=quick(2, eval_every=2), base_domain=str(domain))
        s = finetune(base, tmp_path / domain.stem, cfg, progress=False, log=lines.append).summary
        notes = [line for line in lines if line.startswith("note:") and "unknown to the base's tokenizer" in line]
        last = lines[-1]
        if unknown:
            assert 0.5 < s["base_domain_unk_fraction"] < 1 and len(notes) == 1
            assert f"on {domain} ({s['base_domain_unk_fraction']:.1%} <unk>): " in last, last
        else:
            assert s["base_domain_unk_fraction"] == 0 and not notes and f"on {domain}: " in last, last

def test_epochs_set_the_step_count(base, tmp_path):
    cfg = FinetuneConfig(epochs=0.05, train=quick(warmup_steps=200, eval_every=300), lora=LoRAConfig(r=2),
                         base_domain=None)
    res = finetune(base, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    steps = res.summary["steps"]
    assert steps == steps_for_epochs(0.05, res.summary["train_tokens"], 8, 32) < 200
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["lr"] == pytest.approx(1e-2)  # warm-up cut to the run's steps (as with --steps): it reaches --lr
    assert [r["step"] for r in rows if "val_loss" in r] == [steps]  # and the eval interval too: one at the end
    assert steps_for_epochs(1, 1000, 4, 25) == 10 and steps_for_epochs(0.001, 1000, 4, 25) == 1


def test_full_finetune_writes_a_loadable_base(base, tmp_path):
    cfg = FinetuneConfig(method="full", train=quick(5), base_domain=None)
    res = finetune(base, tmp_path / "full", cfg, progress=False, log=lambda *_: None)
    assert res.summary["trainable_fraction"] == 1.0 and not lora_modules(res.model)
    model, tok = load_base(tmp_path / "full")
    assert tok is not None and model.config == res.model.config
    manifest = json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert manifest["finetuned_sha256"] == sha256_file(tmp_path / "full" / "model.safetensors")


def test_out_must_differ_from_base(base):
    with pytest.raises(InputError, match="differ"):
        finetune(base, base, FinetuneConfig(train=quick(1), base_domain=None), progress=False)


def cli(*args):
    return main(["finetune", *map(str, args), "--no-progress", "--base-domain", "none"])


def test_cli_runs_and_refuses_to_overwrite(base, tmp_path, capsys):
    out = tmp_path / "run"
    common = ("--base", base, "--out", out, "--rank", 2, "--alpha", 4, "--target", "q_proj,v_proj", "--steps", 3,
              "--batch-size", 4)
    assert cli(*common) == 0
    assert (out / ADAPTER_FILE).is_file()
    assert cli(*common) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert cli(*common, "--overwrite") == 0
    assert cli("--base", base, "--out", tmp_path / "more", "--rank", 2, "--alpha", 4, "--target", "q_proj,v_proj",
               "--steps", 2, "--batch-size", 4, "--init-adapter", out) == 0


@pytest.mark.parametrize("args,message", [
    (("--rank", 0), "rank r must be a positive integer"),
    (("--rank", 17), "exceeds min(in, out)"),
    (("--alpha", 0), "alpha must be a positive number"),
    (("--alpha", -1), "alpha must be a positive number"),
    (("--target", "nope"), "valid names"),
    (("--dropout", 1.5), "dropout"),
    (("--data", "/no/such/file.txt"), "not found"),
])
def test_cli_bad_input_is_one_line_exit_2(base, tmp_path, capsys, args, message):
    assert cli("--base", base, "--out", tmp_path / "r", "--steps", 1, "--batch-size", 2, *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_adapter_for_another_rank_or_base_is_exit_2(base, tmp_path, capsys):
    src = tmp_path / "src"
    assert cli("--base", base, "--out", src, "--rank", 4, "--steps", 1, "--batch-size", 2) == 0
    assert cli("--base", base, "--out", tmp_path / "r8", "--rank", 8, "--steps", 1, "--batch-size", 2,
               "--init-adapter", src / ADAPTER_FILE) == 2
    err = capsys.readouterr().err
    assert "this run's rank 8 (the adapter's 4) would scale" in err
    assert err.count("\n") == 1
    wide = make_base(tmp_path / "wide", d_model=32)
    start_wide = ("--base", wide, "--out", tmp_path / "w", "--rank", 4, "--steps", 1, "--batch-size", 2,
                  "--init-adapter", src)
    assert cli(*start_wide) == 2
    assert "not the base this adapter's run trained on" in capsys.readouterr().err  # its run's base_sha256
    assert cli(*start_wide, "--allow-other-base") == 2
    assert "wrong shape" in capsys.readouterr().err
    assert not (tmp_path / "w" / ADAPTER_FILE).exists()


def test_cli_missing_base_is_exit_2(tmp_path, capsys):
    assert cli("--base", tmp_path / "nope", "--out", tmp_path / "r", "--steps", 1) == 2
    assert "no such model folder" in capsys.readouterr().err


def test_grad_checkpoint_flag_trains_the_same_adapter(base, tmp_path):
    """`finetune --grad-checkpoint` recomputes each block in backward: the adapter equals the plain run's."""
    from minituner.adapter_io import read_adapter

    flags = ["finetune", "--base", str(base), "--steps", "4", "--batch-size", "4", "--eval-every", "4",
             "--base-domain", "none", "--no-progress"]
    assert main([*flags, "--out", str(tmp_path / "plain")]) == 0
    assert main([*flags, "--out", str(tmp_path / "ckpt"), "--grad-checkpoint"]) == 0
    plain, _ = read_adapter(tmp_path / "plain" / ADAPTER_FILE)
    ckpt, _ = read_adapter(tmp_path / "ckpt" / ADAPTER_FILE)
    assert plain.keys() == ckpt.keys()
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-6)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["config"]["train"]["grad_checkpoint"] is True


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_heap_trims_flag(base, tmp_path, monkeypatch):
    """CPU training trims the heap before the head of each training forward; --no-heap-trims never does, and
    the two runs train the same adapter bit for bit (trimming hands back pages, never tensors)."""
    from minituner.adapter_io import read_adapter
    from minituner.memory import heap

    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(heap, "free_to_trim", lambda: heap.TRIM_MIN_FREE_BYTES)  # a heap worth trimming
    flags = ["finetune", "--base", str(base), "--steps", "3", "--batch-size", "4", "--eval-every", "3",
             "--base-domain", "none", "--no-progress", "--device", "cpu"]
    assert main([*flags, "--out", str(tmp_path / "trims")]) == 0
    assert len(calls) == 3  # 2 blocks: before the head only, once per training step (evaluation runs no_grad)
    assert main([*flags, "--out", str(tmp_path / "plain"), "--no-heap-trims"]) == 0
    assert len(calls) == 3
    a, _ = read_adapter(tmp_path / "trims" / ADAPTER_FILE)
    b, _ = read_adapter(tmp_path / "plain" / ADAPTER_FILE)
    assert all(torch.equal(a[k], b[k]) for k in a)

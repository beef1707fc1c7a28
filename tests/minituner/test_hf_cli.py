"""Every command on tiny llama / mistral / qwen2 folders, through the CLI: finetune (LoRA, QLoRA, full),
the PEFT folder in PEFT, export, generate stopping at eos, count --base."""
import json
import os
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from minituner.adapter_io import ADAPTER_FILE, load_adapter  # noqa: E402
from minituner.base_model import base_weights_sha256 as sha, load_base  # noqa: E402
from minituner.cli import main  # noqa: E402

IDS = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(4))


def finetune(base, data, out, *extra, checkpoint_every=0, steps=3):
    argv = ["finetune", "--base", str(base), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--batch-size", "2", "--rank", "4", "--alpha", "8", "--lr", "1e-2", "--base-domain", "none", "--no-progress",
            "--checkpoint-every", str(checkpoint_every), *map(str, extra)]
    assert main(argv) == 0


def ours_with_adapter(base, adapter, **load):
    model, _ = load_base(base, **load)
    load_adapter(model, adapter)
    return model.eval()


def hf(folder, hf_ref):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_ref(folder)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_lora_run_loads_in_peft_with_our_logits(hf_folder, hf_ref, data, tmp_path, family, capsys):
    base = hf_folder(family, name=f"{family}-cli")
    finetune(base, data, tmp_path / "run", "--seq-len", 16)
    peft_dir = tmp_path / "run" / "adapter_peft"
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["task_type"] == "CAUSAL_LM"
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["seq_len"] == 16 and len(manifest["base_sha256"]) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(hf(base, hf_ref), peft_dir).eval()
    ours = ours_with_adapter(base, tmp_path / "run")
    with torch.no_grad():
        assert (ours(IDS) - theirs(input_ids=IDS).logits).abs().max() < 1e-4
    capsys.readouterr()


def test_qlora_run_streams_nf4_and_exports_onto_the_dequantized_base(hf_folder, hf_ref, data, tmp_path, capsys):
    base = hf_folder("qwen2", name="qwen2-cli-sharded", max_shard_size="20KB")
    finetune(base, data, tmp_path / "run", "--qlora", "--seq-len", 16, "--target", "q_proj,v_proj,down_proj")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["quant_scheme"] == "nf4_per_group_64" and manifest["results"]["params_total"] == sum(
        p.numel() for p in load_base(base)[0].parameters())
    out = tmp_path / "merged"
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    ours = ours_with_adapter(base, tmp_path / "run", quantize=(["q_proj", "v_proj", "down_proj"], "nf4_per_group_64"))
    with torch.no_grad():
        assert (ours(IDS) - hf(out, hf_ref)(input_ids=IDS).logits).abs().max() < 1e-4
    # an existing OUT needs --overwrite (one line, exit 2, OUT untouched)
    before = (out / "model.safetensors").read_bytes()
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "model.safetensors").read_bytes() == before
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "run"), "--out", str(out), "--overwrite",
                 "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_qlora_run_on_a_folder_resumes_bit_identically(hf_folder, data, tmp_path, capsys):
    """Killed after step 2's checkpoint (step 4's deleted), --resume ends with the same adapter bytes."""
    base = hf_folder("mistral", name="mistral-cli")
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    args = ("--qlora", "--seq-len", 16, "--dropout", 0.1)  # LoRA dropout: the RNG state must resume too
    finetune(base, data, ref, *args, checkpoint_every=2, steps=4)
    shutil.copytree(ref, resumed)
    (resumed / "checkpoints" / "step-00000004.safetensors").unlink()
    finetune(base, data, resumed, *args, "--resume", checkpoint_every=2, steps=4)
    assert (ref / ADAPTER_FILE).read_bytes() == (resumed / ADAPTER_FILE).read_bytes()
    resumes = json.loads((resumed / "manifest.json").read_text())["resumes"]
    assert [r["step"] for r in resumes] == [2]  # it went on from step 2's checkpoint, not from scratch
    capsys.readouterr()


def test_lora_on_a_bf16_base_keeps_its_linears_bf16_and_exports(hf_folder, hf_ref, data, tmp_path, capsys):
    from minigpt.train import TrainConfig
    from minituner.finetune import FinetuneConfig, finetune as finetune_api
    from minituner.lora import LoRAConfig

    base = hf_folder("llama", name="llama-cli-bf16", dtype=torch.bfloat16)
    cfg = FinetuneConfig(data=str(data), lora=LoRAConfig(r=4, alpha=8.0), base_domain=None, seq_len=16,
                         train=TrainConfig(steps=2, batch_size=2, eval_every=2, eval_batches=1))
    res = finetune_api(base, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    stored = {p.dtype for n, p in res.model.named_parameters() if "lora_" not in n and "norm" not in n}
    assert stored == {torch.bfloat16}  # no silent upcast of the Linears, embeddings, head (fp32 products, upcast per product)
    assert {p.dtype for n, p in res.model.named_parameters() if "norm" in n} == {torch.float32}
    assert {p.dtype for n, p in res.model.named_parameters() if "lora_" in n} == {torch.float32}
    out = tmp_path / "merged"
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "run" / "adapter_peft"),
                 "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"  # the base's dtype by default
    capsys.readouterr()


@pytest.mark.parametrize("family", ["mistral", "gpt2"])
def test_full_finetune_writes_a_hugging_face_folder(hf_folder, hf_ref, data, tmp_path, capsys, family):
    """A full fine-tune of a Hugging Face base is a Hugging Face folder of the same family (GPT-2 included, which
    trains as MiniGPT): transformers loads it with our logits, and so does every command of ours."""
    base = hf_folder(family, name=f"{family}-cli")
    finetune(base, data, tmp_path / "run", "--full", "--seq-len", 16)
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["model_type"] == family
    ours, tok = load_base(run)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert tok.eos_ids == ([2] if family == "mistral" else load_base(base)[1].eos_ids)
    with torch.no_grad():
        assert (ours(IDS) - hf(run, hf_ref)(input_ids=IDS).logits).abs().max() < 1e-4
        assert (ours(IDS) - load_base(base)[0](IDS)).abs().max() > 1e-3  # it did train
    capsys.readouterr()


def test_default_window_and_too_long_a_window(hf_folder, data, tmp_path, capsys):
    base = hf_folder("llama", name="llama-cli")
    finetune(base, data, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]["seq_len"] == 64  # min(64, 512)
    capsys.readouterr()
    argv = ["finetune", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "long"), "--seq-len", "65"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--seq-len 65 exceeds the model's context of 64 tokens" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "long").exists()


def test_generate_stops_at_the_eos_id(hf_folder, hf_words, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = tmp_path / "llama"
    shutil.copytree(hf_folder("llama", name="llama-cli"), base)
    words = hf_words + [f"w{i}" for i in range(40 - len(hf_words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(base / "tokenizer.json"))  # every id of the model's 40 decodes to a word
    model, tok = load_base(base)
    prompt = "the wind"
    first = int(model(torch.tensor([tok.encode(prompt)]))[0, -1].argmax())  # what greedy sampling emits next
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    argv = ["generate", "--base", str(base), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "20"]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()[1]
    assert text.split() == [*prompt.split(), tok.decode([first])]  # one token, then it stopped


def test_generate_refuses_a_prompt_that_encodes_to_no_token(hf_folder, hf_words, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = tmp_path / "llama"
    shutil.copytree(hf_folder("llama", name="llama-cli"), base)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(hf_words)}, unk_token=hf_words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a newline alone is no word: no token
    tok.save(str(base / "tokenizer.json"))
    assert main(["generate", "--base", str(base), "--max-new-tokens", "3"]) == 2  # the default prompt, a newline
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "encodes to no token" in err[0]


def test_count_base_plans_from_the_folders_config(hf_folder, capsys):
    base = hf_folder("qwen2", name="qwen2-cli-count", tie_word_embeddings=True)
    assert main(["count", "--base", str(base), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_params"] == sum(p.numel() for p in load_base(base)[0].parameters())
    assert main(["count", "--base", str(base / "config.json")]) == 2
    assert "--base takes a folder" in capsys.readouterr().err


@pytest.mark.parametrize("family,dtype", [("llama", torch.bfloat16), ("gpt2", torch.float16), ("qwen2", torch.float32)])
def test_count_base_plans_the_run_finetune_makes_on_cpu_as_memory_check_does(hf_folder, capsys, tmp_path, family,
                                                                              dtype):
    """count --base adds the CPU fp32 run finetune makes from the folder (a 16-bit checkpoint's weights kept as
    read; GPT-2 loads in fp32): its peak is memory-check --base's prediction for the same run. The GPT-2 folder is
    written without GPT-2's dropout 0.1 (memory-check sets the model's dropout to --model-dropout, 0 by default); a
    folder with it: below."""
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {}
    base = hf_folder(family, name=f"{family}-count-{dtype}", dtype=dtype, **no_dropout)
    window = ["--rank", "4", "--batch-size", "2", "--seq-len", "8", "--target",
              "q_proj,v_proj" if family != "gpt2" else "all-linear"]
    assert main(["count", "--base", str(base), *window, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["finetune_cpu"]
    assert run["base_dtype"] == ("float32" if family == "gpt2" else str(dtype).removeprefix("torch."))
    assert [r["regime"] for r in run["regimes"]] == ["full FT", "LoRA r=4", "QLoRA r=4"]
    for row, regime in zip(run["regimes"], ("full", "lora", "qlora")):
        assert main(["memory-check", "--base", str(base), "--regime", regime, *window, "--steps", "1", "--json"]) == 0
        checked = json.loads(capsys.readouterr().out)
        assert row["peak"] == checked["predicted"]["peak"] and row["weights"] == checked["predicted"]["weights"]
    assert main(["count", "--base", str(base), *window]) == 0
    assert "As `finetune --base` runs it on CPU" in capsys.readouterr().out
    if family == "llama":  # a model finetune refuses: the seed's table, one note, no run planned
        refused = tmp_path / "refused"
        shutil.copytree(base, refused)
        config = json.loads((refused / "config.json").read_text())
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
        (refused / "config.json").write_text(json.dumps(config))
        assert main(["count", "--base", str(refused), *window]) == 0
        out, err = capsys.readouterr()
        assert "| LoRA r=4 |" in out and "As `finetune --base`" not in out
        assert err.count("rope_scaling type") == 1 and len(err.strip().splitlines()) == 1
    if family == "gpt2":  # GPT-2's own names plan the seed's table; finetune trains it as MiniGPT (q_proj, ...)
        assert main(["count", "--base", str(base), "--target", "c_attn"]) == 0
        out, err = capsys.readouterr()
        assert "| LoRA r=4 |" in out and "As `finetune --base`" not in out
        assert "not planned: unknown LoRA target c_attn" in err
        dropout = hf_folder(family, name=f"{family}-count-dropout", dtype=dtype)  # resid_pdrop 0.1, as GPT-2's
        assert main(["count", "--base", str(dropout), *window, "--dropout", "0.05", "--json"]) == 0
        run = json.loads(capsys.readouterr().out)["finetune_cpu"]
        assert (run["model_dropout"], run["lora_dropout"]) == (pytest.approx(0.1), 0.05)
        for row, regime in zip(run["regimes"], ("full", "lora")):  # planned as memory-check measures it
            lora = ["--dropout", "0.05"] if regime != "full" else []
            assert main(["memory-check", "--base", str(dropout), "--regime", regime, *window, *lora,
                         "--model-dropout", "0.1", "--steps", "1", "--json"]) == 0
            checked = json.loads(capsys.readouterr().out)
            assert row["peak"] == checked["predicted"]["peak"]
            assert checked["predicted"]["activations"] == checked["measured"]["activations"]
        assert main(["count", "--base", str(dropout), *window]) == 0
        out, err = capsys.readouterr()
        assert "the model's dropout 0.1 (config.json; attention on SDPA's math path)" in out and err == ""


@pytest.mark.parametrize("qlora", [False, True])
def test_precision_bf16_on_a_bf16_base_keeps_weights_as_read_and_norms_fp32(hf_folder, data, tmp_path, qlora):
    """--precision bf16 on a bf16 checkpoint: Linear/embedding weights stay bf16 (never upcast), norms fp32."""
    from minigpt.train import TrainConfig
    from minituner.finetune import FinetuneConfig, finetune as finetune_api
    from minituner.lora import LoRAConfig

    base = hf_folder("llama", name="llama-cli-bf16", dtype=torch.bfloat16)
    cfg = FinetuneConfig(data=str(data), lora=LoRAConfig(r=4, alpha=8.0), base_domain=None, seq_len=16,
                         quant_scheme="nf4_per_group_64" if qlora else None,
                         train=TrainConfig(steps=2, batch_size=2, eval_every=2, eval_batches=1, precision="bf16"))
    res = finetune_api(base, tmp_path / "run", cfg, progress=False, log=lambda *_: None, allow_slow_bf16=True)
    dtypes = {n: p.dtype for n, p in res.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "norm" in n or "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "norm" not in n and "lora_" not in n)
    assert res.summary["val_loss_after"] == res.summary["val_loss_after"]  # finite, not NaN


def test_export_refuses_a_base_other_than_the_runs(hf_folder, data, tmp_path, capsys):
    """Same shapes, other weights: the merge would load and serve without a sign, so the run's base_sha256 decides."""
    base, other = hf_folder("llama", name="llama-cli"), hf_folder("llama", name="llama-cli-seed1", seed=1)
    finetune(base, data, tmp_path / "run", steps=1)
    capsys.readouterr()
    argv = ["export", "--base", str(other), "--adapter", str(tmp_path / "run" / "adapter_peft"), "--out"]
    assert main([*argv, str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not the base this adapter's run trained on" in err, err
    assert not (tmp_path / "a").exists()
    assert main([*argv, str(tmp_path / "b"), "--allow-other-base"]) == 0
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    # a manifest without the record (edited, or damaged): the run's adapter file records the base too
    manifest = tmp_path / "run" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "base_sha256"}))
    for adapter in (tmp_path / "run", tmp_path / "run" / "adapter_peft"):
        assert main(["export", "--base", str(other), "--adapter", str(adapter), "--out", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert "not the base this adapter's run trained on (its file records" in err, err



def test_finetune_refuses_to_start_from_an_adapter_trained_on_another_base(hf_folder, data, tmp_path, capsys):
    """--init-adapter is checked as eval, generate and export check --adapter: the run's base_sha256 decides."""
    base, other = hf_folder("llama", name="llama-cli"), hf_folder("llama", name="llama-cli-seed1", seed=1)
    finetune(base, data, tmp_path / "run", steps=1)
    capsys.readouterr()

    def start(base, *extra):
        return main(["finetune", "--base", str(base), "--data", str(data), "--out", str(tmp_path / "next"),
                     "--steps", "1", "--batch-size", "2", "--rank", "4", "--base-domain", "none", "--no-progress",
                     *extra])

    for adapter in (tmp_path / "run", tmp_path / "run" / "adapter_peft"):
        assert start(other, "--init-adapter", str(adapter)) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "not the base this adapter's run trained on" in err, err
        assert "--allow-other-base to start from it anyway" in err and not (tmp_path / "next").exists()
    assert start(base, "--allow-other-base") == 2
    assert "--allow-other-base applies to an --init-adapter" in capsys.readouterr().err
    finetune(other, data, tmp_path / "next", "--init-adapter", tmp_path / "run", "--allow-other-base", steps=1)
    finetune(base, data, tmp_path / "again", "--init-adapter", tmp_path / "run", steps=1)
    capsys.readouterr()
    recorded = {run: json.loads((tmp_path / run / "manifest.json").read_text())["config"] for run in ("next", "again")}
    assert recorded["next"]["allow_other_base"] is True and "allow_other_base" not in recorded["again"]


def test_an_adapter_file_copied_out_of_its_run_still_names_its_base(hf_folder, data, tmp_path, capsys):
    """The file records the base's sha256 too, so without the run's manifest beside it another base of the same
    shapes is still refused (it loaded without a word)."""
    base, other = hf_folder("llama", name="llama-cli"), hf_folder("llama", name="llama-cli-seed1", seed=1)
    finetune(base, data, tmp_path / "run", steps=1)
    lone = tmp_path / "elsewhere" / "lone.safetensors"
    lone.parent.mkdir()
    shutil.copy(tmp_path / "run" / ADAPTER_FILE, lone)
    capsys.readouterr()
    evaluate = ["eval", "--data", str(data), "--adapter", str(lone)]
    assert main([*evaluate, "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not the base this adapter's run trained on (its file records" in err, err
    assert main([*evaluate, "--base", str(other), "--allow-other-base"]) == 0
    assert main([*evaluate, "--base", str(base)]) == 0
    capsys.readouterr()

def test_generate_and_eval_refuse_a_base_other_than_the_runs(hf_folder, data, tmp_path, capsys, monkeypatch):
    """An adapter on another model of the same shapes would generate and evaluate without a sign of it."""
    import minituner.run_record as run_record

    base, other = hf_folder("llama", name="llama-cli"), hf_folder("llama", name="llama-cli-seed1", seed=1)
    finetune(base, data, tmp_path / "run", steps=1)
    capsys.readouterr()
    commands = {"generate": ["generate", "--prompt", "ab", "--max-new-tokens", "2"],
                "eval": ["eval", "--data", str(data)]}
    for name, argv in commands.items():
        assert main([*argv, "--base", str(other), "--adapter", str(tmp_path / "run")]) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "not the base this adapter's run trained on" in err, err
        assert main([*argv, "--base", str(other), "--adapter", str(tmp_path / "run"), "--allow-other-base"]) == 0
    # the other model's files given the run's names, sizes and modification times (as a Nix store or a reproducible
    # tar normalises them): other inodes, so they are hashed, and refused
    for weights in (p for p in base.iterdir() if p.suffix == ".safetensors"):
        os.utime(other / weights.name, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))
        assert (other / weights.name).stat().st_size == weights.stat().st_size
    assert main([*commands["generate"], "--base", str(other), "--adapter", str(tmp_path / "run")]) == 2
    capsys.readouterr()
    # the run's base, unchanged since (the file, untouched, that the manifest records): not hashed again
    monkeypatch.setattr(run_record, "base_weights_sha256", lambda folder: pytest.fail("hashed an unchanged base"))
    assert main([*commands["generate"], "--base", str(base), "--adapter", str(tmp_path / "run" / "adapter_peft")]) == 0
    monkeypatch.undo()
    # touched since (same bytes, another mtime): the sha256 decides, and the bytes are the run's
    weights = next(p for p in base.iterdir() if p.suffix == ".safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    hashed = []
    monkeypatch.setattr(run_record, "base_weights_sha256", lambda folder: hashed.append(folder) or sha(folder))
    assert main([*commands["eval"], "--base", str(base), "--adapter", str(tmp_path / "run")]) == 0 and hashed
    capsys.readouterr()


def test_eval_takes_the_runs_window_and_a_long_context_base(hf_folder, data, tmp_path, capsys):
    """eval's window is finetune's: the run's --seq-len (so its val loss is the run's), else min(context, 512), never a
    Llama 3 context of 131,072 tokens as one window (more than all the text: refused before)."""
    base = hf_folder("llama", name="llama-cli")
    finetune(base, data, tmp_path / "run", "--seq-len", 16)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    capsys.readouterr()
    evaluate = ["eval", "--base", str(base), "--data", str(data), "--split", "val", "--json"]
    assert main([*evaluate, "--adapter", str(tmp_path / "run")]) == 0
    by_run = json.loads(capsys.readouterr().out)
    assert by_run["loss"] == pytest.approx(manifest["results"]["val_loss_after"], rel=1e-5)
    assert main([*evaluate, "--adapter", str(tmp_path / "run"), "--seq-len", "16"]) == 0
    assert json.loads(capsys.readouterr().out) == by_run
    assert main([*evaluate, "--seq-len", "65"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 65 exceeds the model's context of 64 tokens" in err and len(err.splitlines()) == 1
    short = hf_folder("llama", name="llama-8", max_position_embeddings=8)  # the run's window does not fit
    assert main([*evaluate, "--adapter", str(tmp_path / "run"), "--base", str(short), "--allow-other-base"]) == 2
    err = capsys.readouterr().err
    assert f"its run trained with --seq-len 16, more than {short}'s context of 8 tokens; give eval --seq-len N" in err
    long_context = hf_folder("llama", name="llama-131k", max_position_embeddings=131072)
    assert main(["eval", "--base", str(long_context), "--data", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == result["examples"] * 512 > 0  # windows of min(131,072, 512)


NO_BF16_UNITS = frozenset({"sse4_2", "avx2", "avx512f"})  # an AVX-512 CPU without avx512_bf16 or amx_bf16


def test_generate_computes_a_bf16_checkpoint_as_stored_where_bf16_is_fast(hf_folder, tmp_path, capsys, monkeypatch):
    """auto: bf16 for a bf16 checkpoint on a CPU with bf16 units (each token reads the weights as stored), else fp32;
    an explicit --precision bf16 without the units is refused in one line, before the base is read."""
    import minituner.commands.generate as generate
    from minigpt.bf16_support import Bf16Support
    from minituner.precision import inference_precision

    fast, slow = Bf16Support(True, ("amx_bf16",), "units"), Bf16Support(False, (), "none")
    assert inference_precision("auto", "bf16", fast) == "bf16"
    assert inference_precision("auto", "bf16", slow) == "fp32"
    assert inference_precision("auto", "fp32", fast) == "fp32"  # an fp32 checkpoint stays fp32
    assert inference_precision("bf16", "fp32", slow) == "bf16"  # as asked (refused by the CLI without units)

    base = hf_folder("llama", name="llama-bf16", dtype=torch.bfloat16)
    argv = ["generate", "--base", str(base), "--prompt", "the wind", "--temperature", "0", "--max-new-tokens", "6"]
    chosen = []
    real = generate.compute_in_bf16
    monkeypatch.setattr(generate, "compute_in_bf16", lambda m: chosen.append("bf16") or real(m))
    texts = {}
    cases = (("auto-fast", [], fast), ("auto-slow", [], slow), ("fp32", ["--precision", "fp32"], fast),
             ("bf16", ["--precision", "bf16", "--allow-slow-bf16"], slow))
    for name, flags, support in cases:
        monkeypatch.setattr(generate, "bf16_support", lambda device="cpu", s=support: s)
        chosen.clear()
        assert main([*argv, *flags]) == 0, name
        texts[name] = capsys.readouterr().out
        assert chosen == (["bf16"] if name in ("auto-fast", "bf16") else []), name
    assert texts["auto-slow"] == texts["fp32"] and texts["auto-fast"] == texts["bf16"]
    # fp32 where the model's fp32 copy would not fit in half the memory available: each product casts its weight
    from minituner.memory.available import Available

    monkeypatch.setattr(generate, "available_memory", lambda: Available(1, "a test's"))
    assert main([*argv, "--precision", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert out == texts["fp32"] and "each product casts its weight to fp32" in err and len(err.splitlines()) == 1
    monkeypatch.setattr("minigpt.bf16_support.cpu_flags", lambda: NO_BF16_UNITS)
    monkeypatch.setattr(generate, "load_base", lambda *a, **k: pytest.fail("read the base before refusing"))
    assert main([*argv, "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "this CPU has no bf16 units" in err


def test_eval_and_generate_put_a_qlora_adapter_on_the_base_it_trained_on(hf_folder, data, tmp_path, capsys,
                                                                         monkeypatch):
    """A QLoRA adapter learned against its targets' NF4 weights: eval and generate read the base so (--quant-scheme
    auto, the run's), so eval reproduces the run's val loss; --quant-scheme none reads the float base instead."""
    base = hf_folder("llama", name="llama-cli")
    finetune(base, data, tmp_path / "run", "--qlora", "--seq-len", 16)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    capsys.readouterr()
    evaluate = ["eval", "--base", str(base), "--adapter", str(tmp_path / "run"), "--data", str(data), "--split", "val",
                "--json"]
    assert main(evaluate) == 0
    nf4 = json.loads(capsys.readouterr().out)["loss"]
    assert nf4 == pytest.approx(manifest["results"]["val_loss_after"], rel=1e-5)
    assert main([*evaluate, "--quant-scheme", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(nf4, rel=1e-5)
    import minituner.trained_model as trained_model

    # the run's adapter file copied without its run: the file records the scheme (the window is then the flag's)
    shutil.copy(tmp_path / "run" / ADAPTER_FILE, tmp_path / "alone.safetensors")
    assert main([*evaluate[:4], str(tmp_path / "alone.safetensors"), *evaluate[5:], "--seq-len", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == nf4
    read = []
    real = trained_model.load_base
    monkeypatch.setattr(trained_model, "load_base", lambda *a, **k: read.append(k["quantize"]) or real(*a, **k))
    generate = ["generate", "--base", str(base), "--adapter", str(tmp_path / "run"), "--prompt", "the wind",
                "--max-new-tokens", "3", "--temperature", "0"]
    assert main(generate) == 0 and read[-1][1] == manifest["config"]["quant_scheme"] == "nf4_per_group_64"
    assert capsys.readouterr().out.splitlines()[1].startswith("the wind")
    assert main([*generate, "--quant-scheme", "NONE"]) == 0 and read[-1] is None
    assert main([*generate, "--quant-scheme", " NF4_per_group_64"]) == 0 and read[-1][1] == "nf4_per_group_64"
    capsys.readouterr()
    monkeypatch.setattr(trained_model, "load_base", lambda *a, **k: pytest.fail("read the base before refusing"))
    monkeypatch.setattr("minituner.run_record.base_weights_sha256", lambda f: pytest.fail("hashed before refusing"))
    no_adapter = generate[:3] + generate[5:]
    for command, message in (([*generate, "--quant-scheme", "nf5"], "--quant-scheme 'nf5': "),
                             ([*generate, "--quant-scheme", ""], "--quant-scheme '': "),
                             ([*no_adapter, "--quant-scheme", "auto"], "--quant-scheme and --allow-other-base apply "
                                                                       "to an --adapter")):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err


def test_eval_computes_in_the_precision_the_run_trained_in(hf_folder, data, tmp_path, capsys, monkeypatch):
    """A bf16 run's val loss was computed in bf16: eval --adapter RUN (auto, on a CPU with bf16 units) computes so too
    and gives it back; --precision fp32 gives the fp32 loss, close to it."""
    import minituner.commands.eval as eval_command
    from minigpt.bf16_support import Bf16Support

    base = hf_folder("llama", name="llama-cli")
    finetune(base, data, tmp_path / "run", "--qlora", "--seq-len", 16, "--precision", "bf16", "--allow-slow-bf16")
    after = json.loads((tmp_path / "run" / "manifest.json").read_text())["results"]["val_loss_after"]
    capsys.readouterr()
    monkeypatch.setattr(eval_command, "bf16_support", lambda device="cpu": Bf16Support(True, ("amx_bf16",), "units"))
    evaluate = ["eval", "--base", str(base), "--adapter", str(tmp_path / "run"), "--data", str(data), "--split", "val",
                "--json", "--allow-slow-bf16"]
    losses = {}
    for precision in ("auto", "bf16", "fp32"):
        assert main([*evaluate, "--precision", precision]) == 0
        losses[precision] = json.loads(capsys.readouterr().out)["loss"]
    assert losses["auto"] == losses["bf16"] == pytest.approx(after, rel=1e-6)
    assert losses["fp32"] == pytest.approx(after, rel=1e-2) and losses["fp32"] != losses["bf16"]

"""The bad-input matrix: every case through the CLI (a subprocess) and through the Python API.

CLI: exit code 2, exactly one line on stderr, no traceback, no output folder created, and every file that
was already there keeps its bytes. API: an InputError (a ValueError) with the same message.
"""
import hashlib
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minigpt.base_folder import save_base
from minituner.base_model import load_base
from minigpt.data import forecast_documents
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.pretrain import pretrain
from minigpt.tokenizer import CharTokenizer
from minigpt.train import TrainConfig
from minituner.adapter_io import ADAPTER_FILE, load_adapter, save_adapter
from minituner.finetune import FinetuneConfig, finetune
from minituner.lora import LoRAConfig, adapter_names, apply_lora
from minituner.peft_format import save_peft_adapter


class RunsCode:
    """Unpickling this object creates `marker`: what a hostile .pt file does on torch.load(weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def hostile_files(folder: Path, marker: Path) -> tuple[Path, Path]:
    """A bare pickle (protocol 4) and a torch.save zip file, each creating `marker` when unpickled."""
    payload = {"blocks.0.attn.q_proj.lora_A.weight": RunsCode(marker)}
    (folder / "evil.pt").write_bytes(pickle.dumps(payload, protocol=4))
    torch.save(payload, folder / "evil_zip.pt")
    return folder / "evil.pt", folder / "evil_zip.pt"


def base_folder(folder: Path, tok: CharTokenizer, d_model: int = 16, n_layer: int = 1) -> Path:
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=n_layer, n_head=2, d_model=d_model)),
              tok, folder)
    return folder


def adapter_file(base: Path, path: Path, r: int = 4) -> Path:
    model, _ = load_base(base)
    apply_lora(model, LoRAConfig(r=r, alpha=8))
    return save_adapter(model, path)


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    """Every input of the matrix, built once."""
    root = tmp_path_factory.mktemp("bad")
    text = "\n\n".join(forecast_documents(300))
    tok = CharTokenizer.train(text)
    (root / "data.txt").write_text(text, encoding="utf-8")
    (root / "empty.txt").write_text("\n\n  \n", encoding="utf-8")
    (root / "unseen.txt").write_text(text.replace("Bergen", "Bergen ☃").replace("rain", "ränn"), encoding="utf-8")
    base = base_folder(root / "base", tok)
    good = adapter_file(base, root / "r4.safetensors")
    blob = good.read_bytes()
    (root / "truncated.safetensors").write_bytes(blob[: len(blob) // 2])
    (root / "random.safetensors").write_bytes(random.Random(0).randbytes(4096))
    hostile_files(root, root / "pwned")
    adapter_file(base_folder(root / "wide_base", tok, d_model=32), root / "wide.safetensors")
    adapter_file(base_folder(root / "deep_base", tok, n_layer=2), root / "deep.safetensors")
    model, _ = load_base(base)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    for name, config in (("peft_malformed", "{ not json"), ("peft_no_r", {"r": None}), ("peft_r_text", {"r": "4"}),
                         ("peft_rslora_text", {"use_rslora": "false"}), ("peft_no_targets", {"target_modules": []})):
        save_peft_adapter(model, root / name)
        cfg_path = root / name / "adapter_config.json"
        if isinstance(config, dict):  # the saved config with these fields changed (None: removed)
            fields = json.loads(cfg_path.read_text()) | config
            config = json.dumps({k: v for k, v in fields.items() if v is not None})
        cfg_path.write_text(config)
    for name, config in (("base_missing", {"model_type": "minigpt", "n_layer": 1}),
                         ("base_gemma", {"model_type": "gemma", "vocab_size": tok.vocab_size, "block_size": 32})):
        shutil.copytree(base, root / name)
        (root / name / "config.json").write_text(json.dumps(config))
    run_cfg = FinetuneConfig(data=str(root / "data.txt"), lora=LoRAConfig(r=2, alpha=4), base_domain=None,
                             train=TrainConfig(steps=2, batch_size=2, eval_every=2, eval_batches=1))
    finetune(base, root / "done", run_cfg, progress=False, log=lambda *_: None)
    pretrain(root / "pretrained", root / "data.txt", dict(block_size=16, n_layer=1, n_head=2, d_model=16),
             TrainConfig(steps=1, batch_size=2, eval_every=1, eval_batches=1), progress=False, log=lambda *_: None)
    return SimpleNamespace(root=root, tok=tok, **{p.stem: p for p in root.iterdir()})


def finetune_cli(f, out, *args, base=None):
    data = () if "--data" in args else ("--data", f.data)
    return ["finetune", "--base", base or f.base, *data, "--out", out, "--steps", 2, "--batch-size", 2,
            "--base-domain", "none", "--no-progress", *args]


def finetune_api(f, out, *, base=None, data=None, init=None, **lora):
    """The library call `minituner finetune` makes, with the same inputs."""
    lora_cfg = LoRAConfig(**{"r": 4, "alpha": 8.0, **lora})
    cfg = FinetuneConfig(data=str(data or f.data), lora=lora_cfg, init_adapter=str(init) if init else None,
                         base_domain=None, train=TrainConfig(steps=2, batch_size=2, eval_every=2, eval_batches=1))
    finetune(base or f.base, out, cfg, progress=False, log=lambda *_: None)


def load_api(f, path, r=4):
    """Loading the adapter on its own: the model keeps no half-loaded adapter."""
    model, _ = load_base(f.base)
    try:
        load_adapter(model, path, config=LoRAConfig(r=r, alpha=8.0))
    finally:
        assert adapter_names(model) == []


# id, CLI arguments (f, out) -> argv (None: a variant checked through the API only), API call (f, out) -> raises,
# and the message fragment both must show
CASES = [
    ("truncated-safetensors", lambda f, o: finetune_cli(f, o, "--init-adapter", f.truncated),
     lambda f, o: load_api(f, f.truncated), "not a readable safetensors file"),
    ("random-bytes", lambda f, o: finetune_cli(f, o, "--init-adapter", f.random),
     lambda f, o: finetune_api(f, o, init=f.random), "not a readable safetensors file"),
    ("pickle-that-runs-code", lambda f, o: finetune_cli(f, o, "--init-adapter", f.evil),
     lambda f, o: load_api(f, f.evil), "refused or unreadable .pt file (weights_only load"),
    ("torch-save-file-that-runs-code", lambda f, o: finetune_cli(f, o, "--init-adapter", f.evil_zip),
     lambda f, o: finetune_api(f, o, init=f.evil_zip), "refused or unreadable .pt file (weights_only load"),
    ("adapter-for-a-wider-base", lambda f, o: finetune_cli(f, o, "--rank", 4, "--alpha", 8, "--init-adapter",
                                                           f.wide),
     lambda f, o: load_api(f, f.wide),
     "wrong shape [blocks.0.attn.k_proj.lora_A.weight (file (4, 32), model (4, 16))"),
    ("adapter-for-a-deeper-base", lambda f, o: finetune_cli(f, o, "--rank", 4, "--alpha", 8, "--init-adapter",
                                                            f.deep),
     lambda f, o: load_api(f, f.deep), "unexpected [blocks.1.attn.k_proj.lora_A.weight"),
    ("rank-mismatch", lambda f, o: finetune_cli(f, o, "--rank", 8, "--alpha", 8, "--init-adapter", f.r4),
     lambda f, o: finetune_api(f, o, r=8, init=f.r4), "this run's rank 8 (the adapter's 4) would scale"),
    ("rank-mismatch-loaded-alone", None, lambda f, o: load_api(f, f.r4, r=8),
     "wrong shape [blocks.0.attn.k_proj.lora_A.weight (file (4, 16), model (8, 16))"),
    ("malformed-adapter-config", lambda f, o: finetune_cli(f, o, "--init-adapter", f.peft_malformed),
     lambda f, o: load_api(f, f.peft_malformed), "adapter_config.json: malformed JSON"),
    ("adapter-config-without-r", lambda f, o: finetune_cli(f, o, "--init-adapter", f.peft_no_r),
     lambda f, o: load_api(f, f.peft_no_r), "no 'r' in the adapter config"),
    ("adapter-config-r-as-text", lambda f, o: finetune_cli(f, o, "--init-adapter", f.peft_r_text),
     lambda f, o: load_api(f, f.peft_r_text), "r must be an integer, got '4'"),
    ("adapter-config-use-rslora-as-text", lambda f, o: finetune_cli(f, o, "--init-adapter", f.peft_rslora_text),
     lambda f, o: load_api(f, f.peft_rslora_text), "use_rslora must be true or false, got 'false'"),
    ("adapter-config-without-targets", lambda f, o: finetune_cli(f, o, "--init-adapter", f.peft_no_targets),
     lambda f, o: load_api(f, f.peft_no_targets), "LoRA target_modules is empty"),
    ("config-missing-fields", lambda f, o: finetune_cli(f, o, base=f.base_missing),
     lambda f, o: finetune_api(f, o, base=f.base_missing), "missing required fields ['block_size', 'vocab_size']"),
    ("config-unknown-model-type", lambda f, o: finetune_cli(f, o, base=f.base_gemma),
     lambda f, o: finetune_api(f, o, base=f.base_gemma), "model_type 'gemma' is not supported"),
    ("r-zero", lambda f, o: finetune_cli(f, o, "--rank", 0),
     lambda f, o: finetune_api(f, o, r=0), "rank r must be a positive integer, got 0"),
    ("r-negative", None,
     lambda f, o: finetune_api(f, o, r=-2), "rank r must be a positive integer, got -2"),
    ("r-above-min-in-out", lambda f, o: finetune_cli(f, o, "--rank", 17),
     lambda f, o: finetune_api(f, o, r=17), "r=17 exceeds min(in, out) = 16"),
    ("alpha-zero", lambda f, o: finetune_cli(f, o, "--alpha", 0),
     lambda f, o: finetune_api(f, o, alpha=0.0), "alpha must be a positive number, got 0.0"),
    ("alpha-negative", None,
     lambda f, o: finetune_api(f, o, alpha=-1.0), "alpha must be a positive number, got -1.0"),
    ("unknown-target", lambda f, o: finetune_cli(f, o, "--target", "q_proj,gate_proj"),
     lambda f, o: finetune_api(f, o, target_modules="q_proj,gate_proj"), "unknown LoRA target 'gate_proj'"),
    ("empty-data", lambda f, o: finetune_cli(f, o, "--data", f.empty),
     lambda f, o: finetune_api(f, o, data=f.empty), "no text found (empty data)"),
    ("characters-the-tokenizer-never-saw", lambda f, o: finetune_cli(f, o, "--data", f.unseen),
     lambda f, o: finetune_api(f, o, data=f.unseen), "2 characters the base tokenizer never saw ('ä', '☃')"),
    ("out-holds-a-run", lambda f, o: finetune_cli(f, f.done),
     lambda f, o: finetune_api(f, f.done), "already holds a run (manifest.json); pass --overwrite"),
    ("resume-without-checkpoint", lambda f, o: finetune_cli(f, f.done, "--resume"),
     lambda f, o: finetune(f.base, f.done, FinetuneConfig(), resume=True), "no checkpoint to resume from"),
    ("out-holds-a-base", lambda f, o: ["pretrain", "--data", f.data, "--out", f.pretrained, "--steps", 1],
     lambda f, o: pretrain(f.pretrained, f.data), "already holds a run (model.safetensors)"),
]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv, _, fragment", [c[1:] for c in CASES if c[1]], ids=[c[0] for c in CASES if c[1]])
def test_cli(f, tmp_path, argv, _, fragment):
    before = snapshot(f.root)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "minituner", *map(str, argv(f, out))], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert fragment in r.stderr, r.stderr
    assert not out.exists()  # no partial output
    assert snapshot(f.root) == before  # nothing that was there changed
    assert not (f.root / "pwned").exists()


@pytest.mark.parametrize("_, call, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_api(f, tmp_path, _, call, fragment):
    before = snapshot(f.root)
    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        call(f, out)
    assert isinstance(info.value, ValueError) and fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert not out.exists() and snapshot(f.root) == before
    assert not (f.root / "pwned").exists()


def test_the_hostile_files_do_run_code_when_loaded_unsafely(tmp_path):
    """The control for the pickle cases: the files really are hostile, so 'no marker' above means something."""
    bare, zipped = hostile_files(tmp_path, tmp_path / "ran")
    pickle.loads(bare.read_bytes())  # never do this (or torch.load(weights_only=False)) with a file you were handed
    assert (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    torch.load(zipped, weights_only=False)
    assert (tmp_path / "ran").exists()


# Hugging Face folders (the tiny llama / qwen2 of conftest.py), each broken one way, through `minituner finetune`
# in-process (cli.main): exit 2, one line on stderr naming the problem, no output folder, the folder unchanged.
def _edit_config(**edit):
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(edit)
        (folder / "config.json").write_text(json.dumps(cfg))
    return apply


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])


def _big_tokenizer(folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"].update({f"w{i}": 100 + i for i in range(60)})
    (folder / "tokenizer.json").write_text(json.dumps(tok))


def _edit_tensor(key: str, edit):
    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        tensors[key] = edit(tensors[key])
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return apply


def _nan_at_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _store_a_different_head(folder: Path) -> None:
    """A config that ties the head, and an lm_head.weight stored anyway that is not the embedding."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(tie_word_embeddings=True)(folder)


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
HF_CASES = {  # id -> (family, sharded, how to break the copy, extra flags, fragment of the one line)
    "integer-weight": ("llama", False, _edit_tensor(Q_PROJ, lambda t: t.to(torch.int32)), [],
                       f"tensor {Q_PROJ} is int32 in model.safetensors; a model's weights are floating point"),
    "nan-weight-qlora": ("llama", False, _edit_tensor(Q_PROJ, _nan_at_first), ["--qlora"],
                         f"tensor {Q_PROJ}: cannot quantize a tensor with NaN or Inf values"),
    "tied-head-stored-differently": ("llama", False, _store_a_different_head, [],
                                     "holds an lm_head.weight that differs from it"),
    "unsupported-model-type": ("llama", False, _edit_config(model_type="gemma"), [],
                               "model_type 'gemma' is not supported"),
    "unsupported-rope-scaling": ("llama", False, _edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), [],
                                 "rope_scaling type 'yarn' is not supported"),
    "missing-shard": ("qwen2", True, lambda f: (f / "model-00002-of-00004.safetensors").unlink(), [],
                      "shard model-00002-of-00004.safetensors is missing"),
    "shape-misfit": ("llama", False, _edit_config(intermediate_size=50), [],
                     "tensor model.layers.0.mlp.gate_proj.weight has shape (48, 32) in model.safetensors, "
                     "the config implies (50, 32)"),
    "tokenizer-larger-than-embedding": ("llama", False, _big_tokenizer, [],
                                        "tokenizer has ids up to 159 but the model only 40"),
    "truncated-safetensors": ("llama", False, _truncate, [], "model.safetensors: not a readable safetensors file"),
    "seq-len-too-long": ("llama", False, lambda f: None, ["--seq-len", "65"],
                         "--seq-len 65 exceeds the model's context of 64 tokens"),
    "qlora-unknown-target": ("llama", False, lambda f: None, ["--qlora", "--target", "c_attn"],
                             "unknown LoRA target 'c_attn'"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_folder_cli(hf_folder, tmp_path, capsys, case):
    pytest.importorskip("transformers")
    from minituner.cli import main

    family, sharded, corrupt, extra, fragment = HF_CASES[case]
    src = hf_folder(family, name=f"{family}-bad{'-sharded' if sharded else ''}",
                    **({"max_shard_size": "20KB", "tie_word_embeddings": True} if sharded else {}))
    base = tmp_path / "base"
    shutil.copytree(src, base)
    corrupt(base)
    (tmp_path / "data.txt").write_text("\n\n".join(["the wind is calm rain later"] * 100))
    before = snapshot(tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()  # what building the fixture printed
    argv = ["finetune", "--base", base, "--data", tmp_path / "data.txt", "--out", out, "--steps", 1, "--batch-size", 1,
            "--base-domain", "none", "--no-progress", *extra]
    assert main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and fragment in err, err
    assert not out.exists() and snapshot(tmp_path) == before

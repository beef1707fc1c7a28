"""`minituner count`: the JSON contract, the Markdown table, errors (one line, exit 2), and exactness
against transformers + PEFT for config.json files of each family as transformers writes them."""
import json
import subprocess
import sys
import warnings

import pytest

from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.cli import main
from minituner.planner import builtin_vocab_size


def count(capsys, *args):
    rc = main(["count", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def count_json(capsys, *args):
    rc, out, err = count(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(autouse=True)
def no_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no artifacts/base/tokenizer.json: MiniGPT presets rebuild the vocabulary


def test_default_is_the_seeds_five_regimes_for_minigpt(capsys):
    d = count_json(capsys)
    assert [(r["name"], r["rank"]) for r in d["regimes"]] == [
        ("full", None), ("lora", 4), ("lora", 8), ("lora", 16), ("qlora", 8)]
    vocab = builtin_vocab_size()
    assert d["model"]["vocab_size"] == vocab
    cfg = GPTConfig(vocab_size=vocab, block_size=128)
    assert d["total_params"] == sum(p.numel() for p in MiniGPT(cfg).parameters())
    assert d["regimes"][2]["trainable_params"] == 4 * 9_216


def test_json_contract_is_exact(capsys):
    d = count_json(capsys, "--preset", "llama-7b", "--rank", "8", "--rank", "16", "--target", "q_proj,v_proj")
    assert list(d) == ["model", "total_params", "regimes", "settings", "batch"]
    assert d["settings"] == {"targets": "q_proj,v_proj", "quantize": "targets", "double_quant": False,
                             "full_precision": "mixed", "master_copy": "weights", "activations": "exact",
                             "grad_checkpoint": False, "alpha": None, "lora_dropout": 0.0, "model_dropout": None}
    assert d["batch"] == {"batch_size": 16, "seq_len": 32, "counted_targets": 16 * 32, "grad_accum": 1}  # all count
    assert [(r["name"], r["rank"]) for r in d["regimes"]] == [
        ("full", None), ("lora", 8), ("lora", 16), ("qlora", 8), ("qlora", 16)]
    for r in d["regimes"]:
        assert set(r) == {"name", "rank", "trainable_params", "frozen_params", "bytes", "ratio_vs_full"}
        # the llama family's default is the exact model, which gives the step's peak and its phase
        assert set(r["bytes"]) == {"weights", "grads", "optimizer", "activations", "total", "peak", "peak_phase"}
        assert isinstance(r["ratio_vs_full"], float)
    assert d["regimes"][1]["trainable_params"] == 4_194_304
    assert d == count_json(capsys, "--preset", "llama-7b", "--rank", "8,16", "--target", "q_proj", "--target", "v_proj")
    assert d == count_json(capsys, "--preset", "llama-7b", "--rank", "8,16,8", "--target", "q_proj,v_proj")  # once each
    zero = count_json(capsys, "--preset", "llama-7b", "--rank", "8", "--target", "q_proj,v_proj", "--master-copy",
                      "optimizer", "--grad-checkpoint")
    assert zero["settings"]["master_copy"] == "optimizer" and zero["settings"]["grad_checkpoint"] is True


def test_flags_change_only_their_bucket(capsys):
    base = count_json(capsys, "--preset", "minigpt-768", "--rank", "8")
    dq = count_json(capsys, "--preset", "minigpt-768", "--rank", "8", "--double-quant")
    assert dq["regimes"][2]["bytes"]["weights"] < base["regimes"][2]["bytes"]["weights"]
    assert dq["regimes"][:2] == base["regimes"][:2]
    act = count_json(capsys, "--preset", "minigpt-768", "--rank", "8", "--batch-size", "2", "--seq-len", "64",
                     "--activations", "seed")
    assert act["regimes"][0]["bytes"]["activations"] == 2 * 64 * 768 * 12 * 16
    assert act["regimes"][0]["bytes"]["weights"] == base["regimes"][0]["bytes"]["weights"]
    qv = count_json(capsys, "--preset", "minigpt-768", "--rank", "8", "--target", "q_proj,v_proj")
    every = count_json(capsys, "--preset", "minigpt-768", "--rank", "8", "--target", "q_proj,v_proj",
                       "--quantize", "all-linear")
    assert every["regimes"][2]["bytes"]["weights"] < qv["regimes"][2]["bytes"]["weights"]
    assert every["regimes"][:2] == qv["regimes"][:2]


def test_default_activation_model_is_the_most_accurate(capsys):
    """MiniGPT and the llama family: the exact model (with the step's peak); the seed's and Korthikanti's by name."""
    mini = count_json(capsys, "--rank", "8", "--batch-size", "2", "--seq-len", "16")
    exact = count_json(capsys, "--rank", "8", "--batch-size", "2", "--seq-len", "16", "--activations", "exact")
    seed = count_json(capsys, "--rank", "8", "--batch-size", "2", "--seq-len", "16", "--activations", "seed")
    assert mini == exact and "peak" in mini["regimes"][1]["bytes"] and "peak" not in seed["regimes"][1]["bytes"]
    assert all(r["bytes"]["peak"] >= r["bytes"]["weights"] + r["bytes"]["optimizer"] for r in mini["regimes"])
    llama = count_json(capsys, "--preset", "llama-7b", "--rank", "8")
    assert llama == count_json(capsys, "--preset", "llama-7b", "--rank", "8", "--activations", "exact")
    assert all("peak" in r["bytes"] for r in llama["regimes"])
    korthikanti = count_json(capsys, "--preset", "llama-7b", "--rank", "8", "--activations", "korthikanti")
    assert "peak" not in korthikanti["regimes"][1]["bytes"]
    ckpt = count_json(capsys, "--rank", "8", "--batch-size", "2", "--seq-len", "16", "--grad-checkpoint")
    assert all(c["bytes"]["activations"] < m["bytes"]["activations"]
               for c, m in zip(ckpt["regimes"], mini["regimes"]))


def test_markdown_output(capsys):
    rc, out, _ = count(capsys, "--preset", "llama-70b", "--rank", "8", "--alpha", "16")
    assert rc == 0
    assert "| regime | trainable params | frozen params | ratio vs full FT |" in out
    assert "| LoRA r=8 | 103,546,880 | 68,976,648,192 | 0.150% |" in out
    assert "lora_alpha 16" in out


def test_tokenizer_sets_minigpt_vocab(capsys, tmp_path):
    CharTokenizer(list("abc")).save(tmp_path / "tok.json")
    d = count_json(capsys, "--tokenizer", str(tmp_path / "tok.json"))
    assert d["model"]["vocab_size"] == 4


def test_minigpt_base_config(capsys, tmp_path):
    cfg = GPTConfig(vocab_size=30, block_size=16, n_layer=2, n_head=2, d_model=16, bias=False, tie_weights=False)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": "minigpt", **cfg.to_dict()}))
    d = count_json(capsys, "--config", str(tmp_path / "base"))
    assert d["total_params"] == sum(p.numel() for p in MiniGPT(cfg).parameters())


@pytest.mark.parametrize("args, fragment", [
    (["--rank", "0"], "--rank must be positive integers"),
    (["--rank", "8,-4"], "--rank must be positive integers"),
    (["--rank", "eight"], "--rank must be positive integers"),
    (["--target", "wq"], "valid: all-linear, fc1, fc2, k_proj, o_proj, q_proj, v_proj"),
    (["--preset", "gpt2", "--target", "q_proj"], "unknown LoRA target q_proj for gpt2; valid: all-linear, c_attn"),
    (["--config", "{tmp}/missing.json"], "file not found"),
    (["--config", "{tmp}/bad.json"], "malformed JSON"),
    (["--config", "{tmp}/falcon.json"], "model_type 'falcon' is not supported; valid: gpt2, llama, minigpt"),
    (["--config", "{tmp}/neg.json"], "hidden_size must be a positive integer"),
    (["--tokenizer", "{tmp}/missing.json"], "tokenizer file not found"),
    (["--batch-size", "0"], "positive integer"),
    (["--full-precision", "fp32", "--master-copy", "optimizer"], "--master-copy applies to --full-precision mixed"),
    (["--preset", "llama-13b"], "invalid choice"),
    (["--rank", "65"], "LoRA rank r=65 exceeds min(in, out) = 64 of attn.q_proj"),  # MiniGPT's d_model 64
    (["--grad-checkpoint", "--activations", "seed"], "--grad-checkpoint needs --activations exact, got --activations seed"),
    (["--config", "{tmp}/ctx.json", "--seq-len", "65"], "--seq-len 65 exceeds the model's context of 64 tokens"),
    (["--seq-len", "129"], "--seq-len 129 exceeds the context of 128 tokens of preset minigpt"),
    (["--preset", "llama-7b", "--seq-len", "2049"], "--seq-len 2049 exceeds the context of 2048 tokens of preset "
                                                    "llama-7b"),
    (["--preset", "llama-70b", "--seq-len", "4097"], "--seq-len 4097 exceeds the context of 4096 tokens of preset "
                                                     "llama-70b"),
])
def test_errors_are_one_line_exit_2(args, fragment, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "falcon.json").write_text('{"model_type": "falcon"}')
    (tmp_path / "neg.json").write_text('{"model_type": "llama", "hidden_size": -4}')
    (tmp_path / "ctx.json").write_text('{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, '
                                       '"num_hidden_layers": 1, "max_position_embeddings": 64}')
    if args[:2] == ["--preset", "gpt2"]:  # no such preset: give a gpt2 config instead
        (tmp_path / "g.json").write_text('{"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1}')
        args = ["--config", str(tmp_path / "g.json"), *args[2:]]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    try:
        rc = main(["count", *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]


def test_the_installed_command_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minituner", "count", "--rank", "8", "--target", "q_proj,nope"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("minituner count: error: unknown LoRA target nope for minigpt; "
                                "valid: all-linear, fc1, fc2, k_proj, o_proj, q_proj, v_proj")


FAMILY_CONFIGS = {
    "gpt2": {"n_embd": 24, "n_head": 3, "n_layer": 2, "n_positions": 20, "vocab_size": 51, "n_inner": 40},
    "llama": {"hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 53, "attention_bias": True, "tie_word_embeddings": True},
    "mistral": {"hidden_size": 32, "intermediate_size": 44, "num_hidden_layers": 3, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 12, "vocab_size": 47},
    "qwen2": {"hidden_size": 48, "intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 6,
              "num_key_value_heads": 2, "vocab_size": 61},
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_cli_matches_transformers_and_peft(family, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.AutoConfig.for_model(family, **FAMILY_CONFIGS[family])
    cfg.save_pretrained(tmp_path)  # a real config.json, defaults left out as transformers writes it
    targets = "c_attn,c_proj" if family == "gpt2" else "q_proj,v_proj"
    for target in (targets, "all-linear"):
        d = count_json(capsys, "--config", str(tmp_path / "config.json"), "--rank", "8", "--target", target)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            assert d["total_params"] == sum(p.numel() for p in model.parameters())
            lora_targets = target if target == "all-linear" else target.split(",")
            wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=lora_targets))
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert [r["trainable_params"] for r in d["regimes"]] == [d["total_params"], trainable, trainable]


def test_a_config_plans_within_its_context_and_notes_what_finetune_would_refuse(tmp_path, capsys):
    small = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4,
             "num_hidden_layers": 1, "vocab_size": 50, "max_position_embeddings": 16}
    (tmp_path / "small.json").write_text(json.dumps(small))
    rc, out, err = count(capsys, "--config", str(tmp_path / "small.json"))
    assert rc == 0 and err == "" and "batch 16, seq 16." in out  # the seed's 32 tokens, cut to the context
    assert count_json(capsys, "--config", str(tmp_path / "small.json")) == count_json(
        capsys, "--config", str(tmp_path / "small.json"), "--seq-len", "16")

    yarn = {**small, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    (tmp_path / "yarn.json").write_text(json.dumps(yarn))
    rc, out, err = count(capsys, "--config", str(tmp_path / "yarn.json"), "--json")
    assert rc == 0 and json.loads(out)["total_params"] == count_json(capsys, "--config", str(tmp_path / "small.json"))[
        "total_params"]  # scaling changes frequencies, not shapes
    assert err.count("\n") == 1 and "finetune would refuse this model" in err
    assert "rope_scaling type 'yarn' is not supported" in err
    rc, _, err = count(capsys, "--config", str(tmp_path / "yarn.json"), "--seq-len", "17")  # refused all the same
    assert rc == 2 and err.strip().endswith("--seq-len 17 exceeds the model's context of 16 tokens "
                                            f"({tmp_path / 'yarn.json'})")

    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 1, "vocab_size": 10, "n_positions": 16}
    (tmp_path / "g.json").write_text(json.dumps({**gpt2, "activation_function": ["gelu_new"]}))  # was a traceback
    rc, out, err = count(capsys, "--config", str(tmp_path / "g.json"))
    assert rc == 0 and f"finetune would refuse this model: {tmp_path / 'g.json'}: activation_function" in err, err


def test_quantizing_every_linear_keeps_the_other_regimes_peaks_and_says_why_qlora_has_none(capsys):
    rc, out, err = count(capsys, "--target", "q_proj,v_proj", "--quantize", "all-linear")
    assert rc == 0 and "No step peak for QLoRA with every block Linear in NF4" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and "MiB" not in line}
    assert rows["QLoRA r=8"].endswith("| – | – |") and "forward" in rows["LoRA r=8"]  # its own peak and phase


def test_full_ft_buckets_follow_the_seed_and_zero_is_an_option(capsys):
    seed = count_json(capsys, "--preset", "minigpt-768", "--rank", "8")
    zero = count_json(capsys, "--preset", "minigpt-768", "--rank", "8", "--master-copy", "optimizer")
    n = seed["total_params"]
    s, z = seed["regimes"][0]["bytes"], zero["regimes"][0]["bytes"]
    assert (s["weights"], s["grads"], s["optimizer"]) == (6 * n, 2 * n, 8 * n)  # fp16 + fp32 master, fp16, Adam m+v
    assert (z["weights"], z["grads"], z["optimizer"]) == (2 * n, 2 * n, 12 * n)  # ZeRO: master with Adam's state
    assert s["total"] == z["total"] and seed["regimes"][1:] == zero["regimes"][1:]


def test_gpt2_count_names_what_finetune_trains_with_c_attn_split(tmp_path, capsys):
    """count gives PEFT's fused c_attn; the note beside it gives the q/k/v split our finetune trains, exactly."""
    from minituner.hf_gpt2 import config_from_gpt2
    from minituner.lora import LoRAConfig, apply_lora

    cfg = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 64, "vocab_size": 40}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, err = count(capsys, "--config", str(tmp_path / "config.json"), "--rank", "4")
    assert rc == 0, err
    model = MiniGPT(config_from_gpt2(cfg, "config.json"))
    apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules="all-linear"))
    ours = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert "| LoRA r=4 | 4,096 |" in out  # PEFT's: r·(d + 3d) + r·2d + r·(d + 4d) + r·(4d + d) per block
    assert f"so it trains {ours:,} at r=4." in out and ours == 4608

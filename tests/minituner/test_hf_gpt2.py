"""Hugging Face GPT-2 folders -> MiniGPT: same logits as transformers, same parameter count, one-line errors."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from minigpt.base_folder import save_base
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.base_model import HFTokenizer, load_base, load_tokenizer
from minituner.hf_gpt2 import config_from_gpt2, load_gpt2, save_gpt2

transformers = pytest.importorskip("transformers")

TINY = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def make_gpt2(folder, seed=0, **overrides):
    """A random GPT2LMHeadModel (every tensor random, LayerNorms too), saved as safetensors into folder."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("ln_1.weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def random_ids(vocab, n_positions, seed=1):
    return torch.randint(0, vocab, (3, n_positions), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def n_params(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # gelu_new, tied, n_inner = 4 * n_embd
        {"activation_function": "gelu", "n_inner": 48, "layer_norm_epsilon": 1e-6},
        {"activation_function": "gelu_pytorch_tanh", "tie_word_embeddings": False},
    ],
    ids=["gelu_new-tied", "gelu-n_inner", "untied"],
)
def test_logits_and_count_match_transformers(tmp_path, overrides):
    hf = make_gpt2(tmp_path, **overrides)
    mini, tokenizer = load_base(tmp_path)
    assert tokenizer is None and not mini.training
    ids = random_ids(TINY["vocab_size"], TINY["n_positions"])
    with torch.no_grad():
        diff = (mini(ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-4, diff
    assert n_params(mini) == n_params(hf)
    assert (mini.lm_head.weight is mini.wte.weight) == overrides.get("tie_word_embeddings", True)
    names = {n for n, _ in mini.named_modules()}
    assert {"blocks.1.attn.q_proj", "blocks.1.attn.k_proj", "blocks.1.attn.v_proj", "blocks.1.mlp.fc2"} <= names


def test_key_variants_load_the_same_model(tmp_path):
    """No `transformer.` prefix, old causal-mask buffers, and a tied lm_head.weight stored explicitly."""
    hf = make_gpt2(tmp_path / "a")
    sd = load_file(tmp_path / "a" / "model.safetensors")
    variant = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for i in range(TINY["n_layer"]):
        variant[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        variant[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    variant["lm_head.weight"] = variant["wte.weight"].clone()
    (tmp_path / "b").mkdir()
    save_file(variant, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    ids = random_ids(TINY["vocab_size"], 20)
    with torch.no_grad():
        assert torch.equal(load_gpt2(tmp_path / "a")(ids), load_gpt2(tmp_path / "b")(ids))
        assert (load_gpt2(tmp_path / "b")(ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_half_precision_weights_load_as_float32(tmp_path):
    make_gpt2(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    save_file({k: v.half() for k, v in sd.items()}, tmp_path / "model.safetensors")
    mini = load_gpt2(tmp_path)
    assert {p.dtype for p in mini.parameters()} == {torch.float32}
    assert torch.equal(mini.wte.weight, sd["transformer.wte.weight"].half().float())


def test_sharded_checkpoint(tmp_path):
    make_gpt2(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: sd[k] for k in part}, tmp_path / name)
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_gpt2(tmp_path).wte.weight, sd["transformer.wte.weight"])


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_export_round_trip(tmp_path, activation):
    """MiniGPT -> GPT-2 folder that transformers loads with the same logits -> MiniGPT with the same tensors."""
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, d_model=16, activation=activation)
    mini = MiniGPT(cfg).eval()
    save_gpt2(mini, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = random_ids(40, 32)
    with torch.no_grad():
        assert (mini(ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    back = load_gpt2(tmp_path)
    assert back.config.to_dict() == mini.config.to_dict()
    sd = back.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in mini.state_dict().items())


def test_minigpt_base_folder_dispatches_to_load_minigpt_folder(tmp_path):
    tok = CharTokenizer.train("abcdef ")
    mini = MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, d_model=8))
    save_base(mini, tok, tmp_path)
    loaded, loaded_tok = load_base(tmp_path)
    assert isinstance(loaded_tok, CharTokenizer) and loaded_tok.itos == tok.itos
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in mini.state_dict().items())


def test_char_tokenizer_beside_gpt2_and_generate_cli(tmp_path):
    make_gpt2(tmp_path)
    CharTokenizer([chr(ord("A") + i) for i in range(TINY["vocab_size"] - 1)]).save(tmp_path / "tokenizer.json")
    _, tok = load_base(tmp_path)
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == TINY["vocab_size"]
    r = subprocess.run([sys.executable, "-m", "minituner", "generate", "--base", str(tmp_path), "--prompt", "ABC",
                        "--max-new-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sample 1" in r.stdout and r.stdout.split("---\n")[1].startswith("ABC")


def test_hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    make_gpt2(tmp_path)
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "the", "weather"])}
    hf_tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf_tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    _, tok = load_base(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 5
    assert tok.encode("hello the weather") == [1, 3, 4]
    assert tok.decode([1, 2]) == "hello world"
    with pytest.raises(InputError, match="ids up to 4 but the model only 4"):
        load_tokenizer(tmp_path, 4)


def test_missing_tokenizer_is_none_with_a_reason(tmp_path):
    make_gpt2(tmp_path)
    assert load_base(tmp_path)[1] is None
    assert "no tokenizer.json" in load_tokenizer(tmp_path, TINY["vocab_size"])[1]


def _edit_config(**changes):
    def edit(folder):
        d = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                d.pop(k)
            else:
                d[k] = v
        (folder / "config.json").write_text(json.dumps(d))
    return edit


def _edit_weights(fn):
    def edit(folder):
        sd = load_file(folder / "model.safetensors")
        fn(sd)
        save_file(sd, folder / "model.safetensors")
    return edit


BAD_FOLDERS = {
    "corrupt weights": (lambda f: (f / "model.safetensors").write_bytes(b"\x00garbage" * 10),
                        "not a readable safetensors"),
    "truncated weights": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:500]),
                          "not a readable safetensors"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no model.safetensors"),
    "no config": (lambda f: (f / "config.json").unlink(), "not a model folder, no config.json"),
    "malformed config": (lambda f: (f / "config.json").write_text("{"), "malformed JSON"),
    "missing n_embd": (_edit_config(n_embd=None), "missing GPT-2 config fields ['n_embd']"),
    "unknown model_type": (_edit_config(model_type="gemma"), "model_type 'gemma' is not supported; valid"),
    "layer-idx scaling": (_edit_config(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    "upcast attention": (_edit_config(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    "cross attention": (_edit_config(add_cross_attention=True), "add_cross_attention"),
    "relu": (_edit_config(activation_function="relu"), "activation_function 'relu' is not supported"),
    "activation as a list": (_edit_config(activation_function=["gelu"]), "activation_function ['gelu'] is not"),
    "tied as text": (_edit_config(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    "heads do not divide": (_edit_config(n_head=5), "n_head=5 does not divide"),
    "config disagrees": (_edit_config(n_embd=64), "has shape (50, 32), config implies (50, 64)"),
    "missing tensor": (_edit_weights(lambda sd: sd.pop("transformer.h.1.mlp.c_fc.bias")),
                       "missing 'h.1.mlp.c_fc.bias'"),
    "extra tensor": (_edit_weights(lambda sd: sd.update({"transformer.h.2.ln_1.weight": torch.ones(32)})),
                     "no place for: ['h.2.ln_1.weight']"),
    "untied head in tied model": (_edit_weights(lambda sd: sd.update({"lm_head.weight": torch.zeros(50, 32)})),
                                  "lm_head.weight differs from wte.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_bad_folder_is_one_input_error(tmp_path, case):
    make_gpt2(tmp_path)
    corrupt, fragment = BAD_FOLDERS[case]
    corrupt(tmp_path)
    with pytest.raises(InputError) as e:
        load_base(tmp_path)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_reports_a_bad_folder_in_one_line(tmp_path):
    make_gpt2(tmp_path)
    _edit_config(model_type="gemma")(tmp_path)
    r = subprocess.run([sys.executable, "-m", "minituner", "generate", "--base", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model_type 'gemma' is not supported" in r.stderr and "gpt2" in r.stderr


def test_config_mapping_is_pure():
    cfg = config_from_gpt2({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
                            "n_layer": 12, "n_head": 12})
    assert (cfg.d_ff, cfg.activation, cfg.tie_weights, cfg.dropout) == (3072, "gelu_tanh", True, 0.1)

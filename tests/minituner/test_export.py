"""export_merged: AutoModelForCausalLM loads the export with our logits (base + adapter) within 1e-4."""
import json
import os
import shutil
import stat

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from minigpt.errors import InputError  # noqa: E402
from minituner.export import export_merged, plan_shards  # noqa: E402
from minituner.hf_gpt2 import load_gpt2  # noqa: E402
from minituner.hf_load import load_hf_decoder  # noqa: E402
from minituner.lora import LoRAConfig, apply_lora, lora_modules  # noqa: E402

IDS = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))


def with_adapter(model, targets="all-linear", seed=5):
    apply_lora(model, LoRAConfig(r=4, alpha=8.0, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("case", ["llama-tied", "qwen2"])
def test_round_trip(hf_folder, hf_ref, tmp_path, case):
    family = case.split("-")[0]
    folder = hf_folder(family, name=f"{case}-export", num_key_value_heads=2, tie_word_embeddings=case.endswith("tied"))
    model = with_adapter(load_hf_decoder(folder))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = export_merged(model, folder, tmp_path / "out")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not changed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]
    assert {"tokenizer.json", "generation_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert (logits(hf_ref(out)) - logits(model)).abs().max() < 1e-4
    mask = os.umask(0)
    os.umask(mask)  # the folder and its files as mkdir and open give them: readable by a server of another user
    assert [stat.S_IMODE(p.stat().st_mode) for p in (out, out / "config.json", out / "model.safetensors")] == \
        [0o777 & ~mask, 0o666 & ~mask, 0o666 & ~mask]


def test_sharded_export(hf_folder, hf_ref, tmp_path):
    folder = hf_folder("mistral", name="mistral-export")
    model = with_adapter(load_hf_decoder(folder), ["q_proj", "down_proj"])
    out = export_merged(model, folder, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    for name in shards:  # fp32: 4 bytes per element; a shard over the limit holds one tensor alone
        with safe_open(str(out / name), "pt") as f:
            payload = sum(4 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
            assert payload <= 20_000 or len(list(f.keys())) == 1
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in load_hf_decoder(out).state_dict().items()
                                                  if k != "lm_head.weight" or "lm_head.weight" in index["weight_map"])
    assert (logits(hf_ref(out)) - logits(model)).abs().max() < 1e-4


def test_qlora_export_dequantizes_first(hf_folder, hf_ref, tmp_path):
    folder = hf_folder("llama", name="llama-plain")
    model = with_adapter(load_hf_decoder(folder, quantize=("all-linear", "nf4_per_group_64")))
    out = export_merged(model, folder, tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any("lora" in k or "absmax" in k for k in keys)
    assert (logits(hf_ref(out)) - logits(model)).abs().max() < 1e-4


def test_bf16_base_exports_bf16_unless_told(hf_folder, tmp_path):
    folder = hf_folder("qwen2", name="qwen2-bf16-export", dtype=torch.bfloat16)
    model = with_adapter(load_hf_decoder(folder), ["v_proj"])
    out = export_merged(model, folder, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    out32 = export_merged(model, folder, tmp_path / "fp32", dtype=torch.float32)
    with safe_open(str(out32 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_existing_out_needs_overwrite(hf_folder, tmp_path):
    folder = hf_folder("llama", name="llama-plain")
    model = with_adapter(load_hf_decoder(folder), ["q_proj"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="already exists"):
        export_merged(model, folder, out)
    assert (out / "keep.txt").read_text() == "mine"  # untouched
    # --overwrite replaces an earlier export, never a folder holding what an export does not write (the user's
    # files, a run's PEFT adapter): those would be deleted with it
    with pytest.raises(InputError, match=r"holds what an export does not write \(keep\.txt\): --overwrite replaces"):
        export_merged(model, folder, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export_merged(model, folder, out, overwrite=True)  # an empty folder
    first = (out / "model.safetensors").read_bytes()
    export_merged(with_adapter(load_hf_decoder(folder), ["v_proj"]), folder, out, overwrite=True)  # an export
    assert (out / "model.safetensors").is_file() and (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left behind
    peft_like = tmp_path / "adapter_peft"
    peft_like.mkdir()
    (peft_like / "adapter_config.json").write_text("{}")
    with pytest.raises(InputError, match=r"\(adapter_config\.json\)"):
        export_merged(model, folder, peft_like, overwrite=True)
    shutil.rmtree(peft_like)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError, match="cannot be created, .*afile is a file, not a folder"):
        export_merged(model, folder, tmp_path / "afile" / "sub")  # was an OSError: [Errno 17] File exists


def test_gpt2_minigpt_exports_as_gpt2(hf_folder, hf_ref, tmp_path):
    folder = hf_folder("gpt2", name="gpt2-export", tie_word_embeddings=True)
    model = with_adapter(load_gpt2(folder), ["q_proj", "v_proj", "fc2"])
    out = export_merged(model, folder, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert len(lora_modules(model)) == 6  # still wrapped: export works on a copy of the merged weights
    assert (logits(hf_ref(out)) - logits(model)).abs().max() < 1e-4


def test_a_minigpt_base_exports_with_a_tokenizer_transformers_reads(tmp_path):
    from minigpt.base_folder import save_base
    from minigpt.model import GPTConfig, MiniGPT
    from minigpt.tokenizer import CharTokenizer
    from minituner.base_model import load_base
    from minituner.sft.templates import load_chat_template

    tok = CharTokenizer.train("The wind turns north-west.\nUser: rain?\tAssistant: <|end|>")
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, d_model=16)), tok,
              tmp_path / "base")
    model, _ = load_base(tmp_path / "base")
    out = export_merged(with_adapter(model, ["q_proj", "fc1"]), tmp_path / "base", tmp_path / "out")

    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["The wind turns north.\nUser: rain?\tAssistant: <|end|>", "Snow é!", "  ", "a <unk> b"]:
        assert auto(text)["input_ids"] == tok.encode(text)  # unknown characters too: id 0
    assert auto.decode(tok.encode("User: rain?\n")) == "User: rain?\n" and len(auto) == tok.vocab_size
    chat = [{"role": "user", "content": "rain?"}, {"role": "assistant", "content": "No."},
            {"role": "user", "content": "wind?"}]
    ours = load_chat_template(tmp_path / "base")  # the template finetune trained with, "<|end|>" ending answers
    assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ours.render(chat, True) \
        == "User: rain?\nAssistant: No.<|end|>\nUser: wind?\nAssistant: "
    assert load_chat_template(out).render(chat, True) == ours.render(chat, True)  # and ours reads it back
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("eos_token_id") is None and cfg.get("bos_token_id") is None  # no 50256 beside a 40-token vocab
    ids = torch.tensor([tok.encode("The wind turns")])
    assert (logits(hf_ref_model(out), ids) - logits(model, ids)).abs().max() < 1e-4
    again, again_tok = load_base(out)  # and back into ours, as a GPT-2 folder with a Hugging Face tokenizer
    assert again_tok.encode("rain? é") == tok.encode("rain? é")


def hf_ref_model(folder):
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def test_plan_shards():
    assert plan_shards({"a": 5, "b": 5, "c": 12, "d": 1}, 10) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards({"a": 5}, 10) == [["a"]]


def test_bad_arguments(hf_folder, tmp_path):
    folder = hf_folder("llama", name="llama-plain")
    model = load_hf_decoder(folder)
    with pytest.raises(InputError, match="max_shard_bytes"):
        export_merged(model, folder, tmp_path / "o", max_shard_bytes=0)
    with pytest.raises(InputError, match="takes a Decoder or a MiniGPT"):
        export_merged(torch.nn.Linear(2, 2), folder, tmp_path / "o")
    assert not (tmp_path / "o").exists()

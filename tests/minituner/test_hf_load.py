"""load_hf_decoder: streaming NF4, the tokenizer and eos ids, and every bad folder refused by name."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file, save_file  # noqa: E402

from minigpt.errors import InputError  # noqa: E402
from miniquant import QuantizedLinear  # noqa: E402
from minituner.hf_config import eos_token_ids  # noqa: E402
from minituner.hf_load import load_hf_decoder, load_hf_tokenizer  # noqa: E402
from minituner.build import quantize_step  # noqa: E402
from minituner.lora import find_targets  # noqa: E402
from minituner.qlora import quantized_modules  # noqa: E402


def copy(folder, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_nf4_equals_quantizing_after_a_full_load(hf_folder, dtype):
    folder = hf_folder("qwen2", name=f"qwen2-{dtype}", dtype=dtype, max_shard_size="20KB")
    streamed = load_hf_decoder(folder, quantize=("all-linear", "nf4_per_group_64"))
    full = load_hf_decoder(folder)
    quantize_step(full, find_targets(full, "all-linear"), "nf4_per_group_64")
    a, b = quantized_modules(streamed), quantized_modules(full)
    assert set(a) == set(b) and len(a) == 2 * 7  # every block Linear; never lm_head
    for path in a:
        assert torch.equal(a[path].weight_packed, b[path].weight_packed), path
        assert torch.equal(a[path].weight_absmax, b[path].weight_absmax), path
        assert a[path].weight_dtype == dtype
        if b[path].bias is not None:
            assert torch.equal(a[path].bias, b[path].bias)
    ids = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        assert torch.equal(streamed(ids), full(ids))


def test_quantize_predicate(hf_folder):
    folder = hf_folder("llama", name="llama-plain")
    model = load_hf_decoder(folder, quantize=lambda path: path.endswith("mlp.down_proj"))
    assert sorted(quantized_modules(model)) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert not any(p.is_meta for p in model.parameters())


def test_tokenizer_and_eos_ids(hf_folder, tmp_path):
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    tok = load_hf_tokenizer(folder, 40)
    assert tok.encode("the wind is calm") == [3, 4, 5, 6]
    assert tok.eos_ids == [2]  # generation_config.json's eos_token_id (an int)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_token_ids(folder) == [2, 7]
    (folder / "generation_config.json").unlink()
    assert eos_token_ids(folder) == [2]  # config.json's
    with pytest.raises(InputError, match="tokenizer has ids up to 16 but the model only 10"):
        load_hf_tokenizer(folder, 10)


def test_missing_shard_is_named(hf_folder, tmp_path):
    folder = copy(hf_folder("qwen2", name="qwen2-tied-sharded", tie_word_embeddings=True, max_shard_size="20KB"), tmp_path)
    (folder / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(InputError, match="shard model-00002-of-00004.safetensors is missing"):
        load_hf_decoder(folder)


def test_shape_that_does_not_fit_the_config(hf_folder, tmp_path):
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 50
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(48, 32\) "
                                         r"in model\.safetensors, the config implies \(50, 32\)"):
        load_hf_decoder(folder)


def test_missing_and_unexpected_tensors(hf_folder, tmp_path):
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    sd = load_file(folder / "model.safetensors")
    sd.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(InputError, match=r"missing tensors the config implies: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_hf_decoder(folder)
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)  # old checkpoints: ignored
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(InputError, match=r"no place for: model\.layers\.0\.extra\.weight$"):
        load_hf_decoder(folder)


def test_truncated_safetensors(hf_folder, tmp_path):
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(InputError, match="model.safetensors: not a readable safetensors file"):
        load_hf_decoder(folder)


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' loads as MiniGPT"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_scaling type 'longrope' is not supported"),
])
def test_bad_config_is_named(hf_folder, tmp_path, edit, match):
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=match) as e:
        load_hf_decoder(folder)
    assert str(e.value).count("config.json") <= 1, str(e.value)  # the file named once


def test_no_weights_and_no_config(tmp_path, hf_folder):
    with pytest.raises(InputError, match="no config.json"):
        load_hf_decoder(tmp_path)
    folder = copy(hf_folder("llama", name="llama-plain"), tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_decoder(folder)


@pytest.mark.parametrize("quantize", [None, ("all-linear", "nf4_per_group_64")])
def test_lora_and_qlora_steps_train_only_the_adapter(hf_folder, quantize):
    from minituner.lora import LoRAConfig, apply_lora
    from minituner.qlora import add_finite_guards, check_qlora

    folder = hf_folder("qwen2", name="qwen2-bf16-train", dtype=torch.bfloat16)
    model = load_hf_decoder(folder, quantize=quantize)  # the frozen base stays bf16
    apply_lora(model, LoRAConfig(r=4, alpha=8.0, target_modules="all-linear"))
    if quantize:
        add_finite_guards(model)
        check_qlora(model)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 40), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())


def _file_mappings(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (Linux /proc/self/maps)."""
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and parts[5] == str(path):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
@pytest.mark.parametrize("quantize", [None, ("all-linear", "nf4_per_group_64")])
def test_loaded_tensors_own_their_memory(hf_folder, tmp_path, quantize):
    # safetensors hands out views of its file mapping; the loader copies what it keeps, so the model holds
    # no mapping of the checkpoint and rewriting the file in place cannot change its weights
    folder = copy(hf_folder("llama", name="llama-bf16-own", dtype=torch.bfloat16), tmp_path)
    model = load_hf_decoder(folder, quantize=quantize)
    file = (folder / "model.safetensors").resolve()
    assert _file_mappings(file) == []
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.dtype in (torch.bfloat16, torch.uint8, torch.float32) for t in tensors)  # no silent upcast
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with open(file, "r+b") as f:  # overwrite the data section in place
        f.seek(0, 2)
        size = f.tell()
        f.seek(size // 2)
        f.write(b"\x7f" * (size - size // 2))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_tied_checkpoint_that_stores_the_head_too_loads_when_it_is_the_embedding(hf_folder, tmp_path):
    folder = tmp_path / "tied"
    shutil.copytree(hf_folder("llama", tie_word_embeddings=True), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_hf_decoder(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tensors["lm_head.weight"][-1, 0] += 1  # the last row differs: another model than the config says
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match="lm_head.weight that differs from it"):
        load_hf_decoder(folder)


def test_qlora_of_a_weight_with_nan_is_refused_before_any_layer_changes(hf_folder):
    model = load_hf_decoder(hf_folder("llama"))
    targets = find_targets(model, ["q_proj", "v_proj"])
    model.model.layers[1].self_attn.v_proj.weight.data[0, 0] = float("nan")
    with pytest.raises(InputError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight holds NaN or Inf"):
        quantize_step(model, targets, "nf4_per_group_64")
    assert not quantized_modules(model)

"""Adapters move between minituner and PEFT with equal logits, in both directions."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minituner.adapter_io import load_adapter
from minituner.lora import LoRAConfig, apply_lora, lora_modules, lora_state_dict
from minituner.adapter_io import load_peft_adapter
from minituner.peft_format import CONFIG_NAME, WEIGHTS_NAME, save_peft_adapter

X = torch.randint(0, 21, (2, 16), generator=torch.Generator().manual_seed(7))


def base_model() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=21, block_size=16, n_layer=2, n_head=2, d_model=16)).eval()


def trained_like(cfg: LoRAConfig) -> MiniGPT:
    model = base_model()
    apply_lora(model, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("cfg", [
    LoRAConfig(r=4, alpha=8),
    LoRAConfig(r=8, alpha=4, use_rslora=True, target_modules="q_proj,v_proj"),
    LoRAConfig(r=2, alpha=3, target_modules=["blocks.1.mlp.fc1", "blocks.0.attn.o_proj"]),
])
def test_peft_loads_our_adapter_with_equal_logits(tmp_path, cfg):
    ours = trained_like(cfg)
    save_peft_adapter(ours, tmp_path / "a", base_model_name_or_path="artifacts/base")
    on_disk = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    assert on_disk["peft_type"] == "LORA" and on_disk["r"] == cfg.r and on_disk["use_rslora"] == cfg.use_rslora
    theirs = peft.PeftModel.from_pretrained(base_model(), tmp_path / "a").eval()
    assert not torch.equal(ours(X), base_model()(X))
    torch.testing.assert_close(theirs(X), ours(X), rtol=0, atol=1e-5)
    n_wrapped = sum(1 for _, m in theirs.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert n_wrapped == len(lora_modules(ours))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_we_load_an_adapter_peft_trained_with_equal_logits(tmp_path, use_rslora):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_rslora=use_rslora,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"])
    theirs = peft.get_peft_model(base_model(), cfg)
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    theirs.train()
    for _ in range(3):
        logits = theirs(X[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 21), X[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    theirs.eval()
    assert all(torch.count_nonzero(p) for n, p in theirs.named_parameters() if "lora_B" in n)
    theirs.save_pretrained(tmp_path / "p")
    ours = base_model()
    loaded = load_peft_adapter(ours, tmp_path / "p")
    assert (loaded.r, loaded.alpha, loaded.use_rslora) == (4, 8.0, use_rslora)
    assert len(lora_modules(ours)) == 12
    torch.testing.assert_close(ours(X), theirs(X), rtol=0, atol=1e-5)
    peft_keys = {k.replace("base_model.model.", "").replace(".default", "") for k, p in theirs.named_parameters() if "lora_" in k}
    assert set(lora_state_dict(ours)) == peft_keys



def test_peft_exclude_modules_select_as_in_peft_with_equal_logits(tmp_path):
    """exclude_modules (matched as target_modules are) takes modules out of PEFT's selection: such an adapter loads
    with PEFT's logits; tensors for an excluded module are refused, as PEFT would leave them out."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "fc1", "fc2"], exclude_modules=["fc2"],
                          init_lora_weights="gaussian")
    theirs = peft.get_peft_model(base_model(), cfg)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    theirs.eval()
    theirs.save_pretrained(tmp_path / "p")
    ours = base_model()
    load_peft_adapter(ours, tmp_path / "p")
    assert sorted(lora_modules(ours)) == [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.q_proj", "mlp.fc1")]
    torch.testing.assert_close(ours(X), theirs(X), rtol=0, atol=1e-5)
    config = tmp_path / "p" / CONFIG_NAME
    config.write_text(json.dumps({**json.loads(config.read_text()), "exclude_modules": "blocks\\.1\\..*"}))
    with pytest.raises(InputError, match=r"less exclude_modules '.*' does not select \(blocks\.1\."):
        load_peft_adapter(base_model(), tmp_path / "p")
    # a module the selection takes (target_modules less exclude_modules) without tensors: refused, model untouched
    config.write_text(json.dumps({**json.loads(config.read_text()), "exclude_modules": ["fc2"]}))
    weights = tmp_path / "p" / WEIGHTS_NAME
    sd = load_file(weights)
    save_file({k: v for k, v in sd.items() if "blocks.1.mlp.fc1" not in k}, weights)
    model = base_model()
    with pytest.raises(InputError, match=r"select 1 module\(s\) of this model it holds no tensors for "
                                         r"\(blocks\.1\.mlp\.fc1\)"):
        load_peft_adapter(model, tmp_path / "p")
    assert not lora_modules(model)

def test_generic_loader_reads_peft_folders(tmp_path):
    ours = trained_like(LoRAConfig(r=4, alpha=8))
    save_peft_adapter(ours, tmp_path / "a")
    again = base_model()
    load_adapter(again, tmp_path / "a")  # a folder with adapter_config.json
    assert torch.equal(again(X), ours(X))


def test_peft_adapter_for_another_rank_names_keys(tmp_path):
    save_peft_adapter(trained_like(LoRAConfig(r=4)), tmp_path / "a")
    model = base_model()
    with pytest.raises(InputError, match="wrong shape"):
        load_adapter(model, tmp_path / "a", config=LoRAConfig(r=2))


@pytest.mark.parametrize("field,value", [("use_dora", True), ("peft_type", "IA3"), ("rank_pattern", {"fc1": 2}),
                                         ("modules_to_save", ["lm_head"]), ("bias", "all"),
                                         ("layers_to_transform", [0]), ("layers_pattern", "blocks"),
                                         ("task_type", "SEQ_CLS"), ("alora_invocation_tokens", [5, 6]),
                                         ("target_parameters", ["blocks.0.mlp.fc1.weight"]),
                                         ("trainable_token_indices", [1, 2]), ("use_qalora", True),
                                         ("a_field_of_a_later_peft", {"on": True}), ("layer_replication", [[0, 1]]),
                                         ("init_lora_weights", "pissa"), ("init_lora_weights", "loftq"),
                                         ("init_lora_weights", 1)])
def test_unsupported_peft_features_are_refused(tmp_path, field, value):
    save_peft_adapter(trained_like(LoRAConfig(r=4)), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    cfg[field] = value
    (tmp_path / "a" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=field):
        load_peft_adapter(base_model(), tmp_path / "a")



def test_tensors_for_modules_the_config_does_not_target_are_refused(tmp_path):
    """PEFT puts LoRA only on the modules target_modules selects (a list by name or path suffix, a string as a
    regular expression over the whole path) and leaves other tensors out; we took every tensor's module."""
    save_peft_adapter(trained_like(LoRAConfig(r=4, target_modules=["q_proj", "fc1"])), tmp_path / "a")
    config = tmp_path / "a" / CONFIG_NAME
    cfg = json.loads(config.read_text())
    # (all-linear selects every Linear: those without tensors are refused, the test below; null is PEFT's default
    # targets for the model type, and PEFT has none for a MiniGPT: test_hf_peft has null on a Llama)
    for targets, refused in [(["q_proj"], True), ("blocks\\.0\\..*", True), (["q_proj", "fc1"], False),
                             (".*\\.(q_proj|fc1)", False), ("all-linear", True), (None, True), ("(", True)]:
        config.write_text(json.dumps({**cfg, "target_modules": targets}))
        if refused:
            with pytest.raises(InputError, match="does not select|not a regular expression|holds no tensors for|"
                                                 "target_modules is null"):
                load_peft_adapter(base_model(), tmp_path / "a")
        else:
            loaded = load_peft_adapter(base_model(), tmp_path / "a")
            assert len(loaded.target_modules) == 2 * base_model().config.n_layer, targets


def test_peft_folder_without_weights_is_input_error(tmp_path):
    save_peft_adapter(trained_like(LoRAConfig(r=4)), tmp_path / "a")
    (tmp_path / "a" / WEIGHTS_NAME).unlink()
    with pytest.raises(InputError, match="no adapter_model"):
        load_peft_adapter(base_model(), tmp_path / "a")


def test_an_adapter_lacking_modules_its_targets_select_is_refused(tmp_path):
    """An adapter trained on a deeper model of the same widths (or cut short) holds tensors for fewer layers than
    its target_modules select here; PEFT loads it with a warning and those layers' LoRA at its initialization
    (B = 0), so part of the training would be missing silently. Both formats are refused by name; the model is
    left as it was."""
    from minituner.adapter_io import save_adapter

    for_one_layer = {k: v for k, v in lora_state_dict(trained_like(LoRAConfig(r=4, target_modules=["q_proj"]))).items()
                     if k.startswith("blocks.0.")}
    shallow = MiniGPT(GPTConfig(vocab_size=21, block_size=16, n_layer=1, n_head=2, d_model=16))
    apply_lora(shallow, LoRAConfig(r=4, target_modules=["q_proj"]))
    from minituner.lora import load_lora_state_dict
    load_lora_state_dict(shallow, for_one_layer)
    save_peft_adapter(shallow, tmp_path / "peft")
    save_adapter(shallow, tmp_path / "ours.safetensors")
    assert json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())["target_modules"] == ["q_proj"]
    deeper = base_model()  # 2 layers: q_proj selects blocks.0 and blocks.1
    before = deeper(X)
    with pytest.raises(InputError, match=r"target_modules select 1 module\(s\) of this model it holds no tensors "
                                         r"for \(blocks\.1\.attn\.q_proj\)"):
        load_peft_adapter(deeper, tmp_path / "peft")
    assert not lora_modules(deeper) and torch.equal(deeper(X), before)
    # ours records the paths its run wrapped: on the deeper model it loads where those are, as finetune made it
    assert load_adapter(deeper, tmp_path / "ours.safetensors").target_modules == ["blocks.0.attn.q_proj"]

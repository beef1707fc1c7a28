"""The planner's counts for Hugging Face families equal transformers' models and PEFT's LoRA, exactly.

Random small configs of gpt2, llama, mistral and qwen2 are instantiated on the meta device (no memory,
no init); the reference is sum(p.numel()) over parameters (tied weights once) and, after
get_peft_model, the parameters that require grad.
"""
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from minigpt.errors import InputError  # noqa: E402
from minituner.planner import lora_trainable_params, param_counts, shape_from_config, total_params  # noqa: E402

TARGETS = {
    "gpt2": [["c_attn"], ["c_proj"], ["c_attn", "c_fc"], ["attn.c_proj"], "all-linear"],
    "llama": [["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"], "all-linear"],
}
TARGETS["mistral"] = TARGETS["qwen2"] = TARGETS["llama"]


def build_meta(config: dict):
    """transformers' model for this config dict, on the meta device."""
    cfg = transformers.AutoConfig.for_model(**config)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(cfg)


def peft_trainable(config: dict, r: int, targets) -> int:
    model = build_meta(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Conv1D fan_in_fan_out notice
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=targets))
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not any("lm_head" in n for n in names)  # all-linear never wraps the output head
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@st.composite
def rotary_configs(draw, family):
    n_kv = draw(st.integers(1, 3))
    n_head = n_kv * draw(st.integers(1, 3))
    cfg = {
        "model_type": family,
        "hidden_size": n_head * draw(st.integers(1, 6)) * 2,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "intermediate_size": draw(st.integers(1, 40)),
        "num_hidden_layers": draw(st.integers(1, 3)),
        "vocab_size": draw(st.integers(3, 120)),
        "tie_word_embeddings": draw(st.booleans()),
    }
    if family != "qwen2" and draw(st.booleans()):
        cfg["head_dim"] = 2 * draw(st.integers(1, 5))  # decoupled from hidden_size / heads (RoPE needs it even)
    if family == "llama":
        cfg["attention_bias"] = draw(st.booleans())
        cfg["mlp_bias"] = draw(st.booleans())
    return cfg


@st.composite
def gpt2_configs(draw):
    n_head = draw(st.integers(1, 4))
    cfg = {
        "model_type": "gpt2",
        "n_embd": n_head * draw(st.integers(1, 6)),
        "n_head": n_head,
        "n_layer": draw(st.integers(1, 3)),
        "n_positions": draw(st.integers(1, 64)),
        "vocab_size": draw(st.integers(3, 120)),
        "tie_word_embeddings": draw(st.booleans()),
    }
    if draw(st.booleans()):
        cfg["n_inner"] = draw(st.integers(1, 40))
    return cfg


def check_family(config: dict, r: int) -> None:
    shape = shape_from_config(config, config["model_type"])
    assert total_params(shape) == numel(build_meta(config))
    for targets in TARGETS[config["model_type"]]:
        assert lora_trainable_params(shape, r, targets) == peft_trainable(config, r, targets), targets


SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(config=gpt2_configs(), r=st.integers(1, 9))
def test_gpt2_matches_transformers_and_peft(config, r):
    check_family(config, r)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_rotary_families_match_transformers_and_peft(family):
    @SETTINGS
    @given(config=rotary_configs(family), r=st.integers(1, 9))
    def check(config, r):
        check_family(config, r)

    check()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2"])
def test_family_defaults_match_config_class(family):
    """A config that gives only the small sizes leaves the rest to the config class's defaults."""
    if family == "gpt2":
        config = {"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "vocab_size": 50}
    else:  # heads chosen so the family's default num_key_value_heads (llama: = heads, mistral 8, qwen2 32) groups
        heads = 32 if family == "qwen2" else 8
        config = {"model_type": family, "hidden_size": 2 * heads, "intermediate_size": 24, "num_hidden_layers": 1,
                  "num_attention_heads": heads, "vocab_size": 50}
    shape = shape_from_config(config, family)
    assert total_params(shape) == numel(build_meta(config))
    assert lora_trainable_params(shape, 2, "all-linear") == peft_trainable(config, 2, "all-linear")
    assert shape.n_kv_head == {"gpt2": 2, "llama": 8, "mistral": 8, "qwen2": 32}[family]



@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_null_kv_heads_mean_one_per_query_head_as_transformers_reads_them(family):
    """num_key_value_heads given as null is num_attention_heads in the config classes' __init__ (Qwen2's default
    when the key is absent is 32); the count follows transformers either way."""
    config = {"model_type": family, "hidden_size": 128, "intermediate_size": 24, "num_hidden_layers": 1,
              "num_attention_heads": 64, "num_key_value_heads": None, "vocab_size": 50}
    shape = shape_from_config(config, family)
    assert shape.n_kv_head == 64
    assert total_params(shape) == numel(build_meta(config))

def test_qwen2_biases_on_q_k_v_only():
    config = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 9}
    shape = shape_from_config(config, "q")
    assert param_counts(shape)["attention_bias"] == 2 * (16 + 2 * 2 * 4)  # q (16) + k, v (2 heads x 4) per layer
    assert param_counts(shape)["mlp_bias"] == 0
    assert total_params(shape) == numel(build_meta(config))


def test_mistral_default_kv_heads_must_divide_heads():
    # MistralConfig defaults num_key_value_heads to 8: with 4 heads that cannot group, and we say so.
    with pytest.raises(InputError, match="num_key_value_heads=8"):
        shape_from_config({"model_type": "mistral", "hidden_size": 16, "num_attention_heads": 4}, "m")


def test_gpt2_c_proj_matches_attention_and_mlp():
    shape = shape_from_config({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 3, "vocab_size": 11}, "g")
    h, ff, r = 8, 32, 4
    assert lora_trainable_params(shape, r, ["c_proj"]) == 3 * (r * (h + h) + r * (ff + h))
    assert lora_trainable_params(shape, r, ["attn.c_proj"]) == 3 * r * (h + h)
    assert lora_trainable_params(shape, r, "all-linear") == 3 * r * ((h + 3 * h) + 2 * h + (h + ff) + (ff + h))

"""The Decoder computes transformers' llama, mistral and qwen2 models: logits within 1e-4 (fp32).

Each case is a tiny random model written by save_pretrained and loaded by load_hf_decoder; the
reference is AutoModelForCausalLM.from_pretrained on the same folder.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from minigpt.decoder import Decoder, DecoderConfig, apply_rope, rope_inv_freq, signed_sin  # noqa: E402
from minigpt.errors import InputError  # noqa: E402
from minigpt.model import GPTConfig, MiniGPT  # noqa: E402
from minituner.hf_config import decoder_config_from_hf  # noqa: E402
from minituner.hf_load import load_hf_decoder  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama-mha-untied": ("llama", {}),
    "llama-gqa-tied-biases": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
                                            mlp_bias=True)),
    "llama-head_dim-llama3-rope": ("llama", dict(head_dim=12, num_key_value_heads=1, rope_scaling=LLAMA3,
                                                 rope_theta=500000.0)),
    "mistral-gqa-sliding": ("mistral", {}),
    "mistral-mha-sharded": ("mistral", dict(num_key_value_heads=4, sliding_window=None, tie_word_embeddings=True,
                                            max_shard_size="20KB")),
    "qwen2-biases-sliding-layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    "qwen2-tied-sharded": ("qwen2", dict(tie_word_embeddings=True, max_shard_size="20KB")),
}
IDS = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(1))


def folder_of(hf_folder, case):
    family, overrides = CASES[case]
    return hf_folder(family, name=case, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(hf_folder, hf_ref, case):
    folder = folder_of(hf_folder, case)
    ref = hf_ref(folder)
    ours = load_hf_decoder(folder)
    assert set(ours.state_dict()) == set(ref.state_dict())  # Hugging Face's names, key for key
    with torch.no_grad():
        expected = ref(IDS).logits
        got = ours(IDS)
    assert got.shape == expected.shape == (2, 13, 40)
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std() > 0.5  # the weights are not so small that any model would pass


def test_cases_cover_the_features(hf_folder):
    cfgs = {case: load_hf_decoder(folder_of(hf_folder, case)).config for case in CASES}
    assert cfgs["llama-gqa-tied-biases"].n_kv_head < cfgs["llama-gqa-tied-biases"].n_head
    assert cfgs["llama-gqa-tied-biases"].qkv_bias and cfgs["llama-gqa-tied-biases"].mlp_bias
    assert cfgs["llama-head_dim-llama3-rope"].head_dim * 4 != 32 and cfgs["llama-head_dim-llama3-rope"].rope_type == "llama3"
    assert cfgs["mistral-gqa-sliding"].sliding_window == 4 < IDS.shape[1]
    assert cfgs["mistral-gqa-sliding"].sliding_layers == [0, 1]
    assert cfgs["mistral-mha-sharded"].sliding_window is None
    assert cfgs["qwen2-biases-sliding-layer1"].sliding_layers == [1]  # layers >= max_window_layers
    assert cfgs["qwen2-tied-sharded"].sliding_window is None  # use_sliding_window defaults to false
    assert (folder_of(hf_folder, "qwen2-tied-sharded") / "model.safetensors.index.json").is_file()


def test_sliding_window_changes_late_positions(hf_folder):
    model = load_hf_decoder(folder_of(hf_folder, "mistral-gqa-sliding"))
    with torch.no_grad():
        windowed = model(IDS)
        for layer in model.model.layers:
            layer.self_attn.window = None
        full = model(IDS)
    assert torch.equal(windowed[:, :4], full[:, :4])  # within the window the mask is the causal one
    assert (windowed[:, 4:] - full[:, 4:]).abs().max() > 1e-3


def test_llama3_frequencies_equal_transformers(hf_folder, hf_ref):
    folder = folder_of(hf_folder, "llama-head_dim-llama3-rope")
    ours = rope_inv_freq(load_hf_decoder(folder).config)
    theirs = hf_ref(folder).model.rotary_emb.inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(DecoderConfig(head_dim=12, rope_theta=500000.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_sign_on_the_table_is_transformers_rope_bit_for_bit(dtype):
    """apply_rope(x, cos, signed_sin(sin)) equals transformers' x·cos + rotate_half(x)·sin exactly, and so do the
    gradients that reach x."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    model = Decoder(DecoderConfig(n_head=4, n_kv_head=2, d_model=64))
    cos, sin = model.rope(16, torch.device("cpu"), dtype, start=3)
    g = torch.Generator().manual_seed(0)
    q, k, grad_q, grad_k = (torch.randn(2, h, 16, 16, generator=g).to(dtype) for h in (4, 2, 4, 2))
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    ours = apply_rope(q1, cos, signed_sin(sin)), apply_rope(k1, cos, signed_sin(sin))
    theirs = apply_rotary_pos_emb(q2, k2, cos[None], sin[None])
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and torch.equal(a, b)
    torch.autograd.backward(ours, (grad_q, grad_k))
    torch.autograd.backward(theirs, (grad_q, grad_k))
    assert torch.equal(q1.grad, q2.grad) and torch.equal(k1.grad, k2.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_checkpoint_keeps_its_dtype(hf_folder, hf_ref, dtype):
    folder = hf_folder("llama", name=f"llama-{dtype}", dtype=dtype, num_key_value_heads=2)
    model = load_hf_decoder(folder)
    assert {p.dtype for p in model.parameters()} == {dtype}
    up = load_hf_decoder(folder, dtype=torch.float32)
    assert {p.dtype for p in up.parameters()} == {torch.float32}
    ref = hf_ref(folder, dtype=torch.float32)
    with torch.no_grad():  # the fp32 upcast of the same bf16 weights computes transformers' fp32 logits
        assert (up(IDS) - ref(IDS).logits).abs().max() < 1e-4
        assert model(IDS).dtype == dtype


def test_generate_stops_at_eos():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 8, temperature=0)
    first = int(greedy[0, 3])
    stopped = model.generate(prompt, 8, temperature=0, eos_id=[first, 10])
    assert stopped.tolist() == [[1, 2, 3, first]]
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(torch.tensor([[1], [2]]), 5, temperature=1.0, top_k=3, generator=g)
    assert sampled.shape == (2, 6)


def test_config_round_trip_and_validation():
    cfg = DecoderConfig(n_head=4, n_kv_head=2, d_model=32, sliding_window=8, sliding_layers=[1])
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 8 and cfg.d_ff == 128
    with pytest.raises(InputError, match="num_key_value_heads=3"):
        DecoderConfig(n_head=4, n_kv_head=3)
    with pytest.raises(InputError, match="unknown DecoderConfig fields"):
        DecoderConfig.from_dict({"n_heads": 2})


@pytest.mark.parametrize("scaling,name", [({"type": "yarn", "factor": 4.0}, "yarn"),
                                          ({"rope_type": "dynamic", "factor": 2.0}, "dynamic")])
def test_unsupported_rope_scaling_is_named(scaling, name):
    cfg = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2, "rope_scaling": scaling}
    with pytest.raises(InputError, match=f"rope_scaling type '{name}' is not supported"):
        decoder_config_from_hf(cfg, "c.json")
    assert decoder_config_from_hf(cfg, "c.json", check_rope=False).rope_type == "default"  # the planner's reading


def test_unsupported_model_type_is_named():
    with pytest.raises(InputError, match="model_type 'gemma' is not supported"):
        decoder_config_from_hf({"model_type": "gemma"}, "c.json")


def test_gpt_style_variant_equals_minigpt():
    """LayerNorm, learned positions and a GELU MLP: the same function as MiniGPT with the same weights."""
    torch.manual_seed(0)
    mini = MiniGPT(GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, d_model=16)).eval()
    cfg = DecoderConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, n_kv_head=2, d_model=16, d_ff=64,
                        norm="layernorm", norm_eps=1e-5, norm_bias=True, positions="learned", mlp="gelu",
                        activation="gelu", qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True)
    dec = Decoder(cfg).eval()
    names = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm", "blocks": "model.layers",
             "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn": "self_attn", "fc1": "up_proj",
             "fc2": "down_proj"}
    sd = {}
    for k, v in mini.state_dict().items():
        sd[".".join(names.get(part, part) for part in k.split("."))] = v
    dec.load_state_dict(sd)
    ids = torch.randint(0, 23, (2, 16))
    with torch.no_grad():
        assert (dec(ids) - mini(ids)).abs().max() < 1e-5


@pytest.mark.parametrize("case", ["llama-gqa-tied-biases", "llama-head_dim-llama3-rope", "mistral-gqa-sliding",
                                  "qwen2-biases-sliding-layer1"])
def test_cached_greedy_generation_equals_transformers(hf_folder, hf_ref, case):
    """Our generate (KV cache: prefill, then one token a step) picks transformers' greedy tokens (its own cache),
    past the sliding windows; and the logits of each cached step equal transformers' full forward."""
    folder = folder_of(hf_folder, case)
    ref, ours = hf_ref(folder), load_hf_decoder(folder)
    prompt = IDS[:, :6]
    with torch.no_grad():
        theirs = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                              do_sample=False, pad_token_id=0)
        mine = ours.generate(prompt, 20, temperature=0)
        cache = ours.new_kv_cache(mine.shape[1])
        steps = [ours(mine[:, :6], cache=cache)] + [ours(mine[:, t:t + 1], cache=cache) for t in range(6, mine.shape[1])]
        full = ref(mine).logits
    assert torch.equal(mine, theirs)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-4


def test_first_attention_of_a_process_inside_a_checkpointed_layer():
    """A fresh process whose first grouped-query attention runs under torch.utils.checkpoint: the question
    whether the CPU flash kernel takes enable_gqa is asked at import, so it adds nothing to the layer's saved
    tensors (asked inside, the recomputation saved fewer tensors than the forward and the backward failed)."""
    import subprocess
    import sys

    code = ("import torch; from minigpt.decoder import Decoder, DecoderConfig\n"
            "m = Decoder(DecoderConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_kv_head=2, d_model=16)); "
            "m.grad_checkpoint = True; m.train()\n"
            "m(torch.randint(0, 11, (2, 8))).sum().backward(); print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

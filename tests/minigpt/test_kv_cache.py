"""Generation with a key/value cache equals generation without: logits, greedy and sampled tokens, at the
context's edge and past it, for MiniGPT and for the Decoder's families (GQA, sliding window, learned positions,
biases), with LoRA, QLoRA and bf16 compute on top."""
from __future__ import annotations

import pytest
import torch

from minigpt.decoder import Decoder, DecoderConfig
from minigpt.errors import InputError
from minigpt.kv_cache import KVCache, attention_mask
from minigpt.model import GPTConfig, MiniGPT
from minigpt.sampling import generate

VOCAB, BLOCK = 48, 24


def minigpt() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, d_model=16)).eval()


def decoder(**kw) -> Decoder:
    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48)
    return Decoder(DecoderConfig(**{**cfg, **kw})).eval()


MODELS = {
    "minigpt": minigpt,
    "llama-gqa": decoder,
    "mistral-window": lambda: decoder(sliding_window=5, sliding_layers=[0, 1]),
    "qwen2-bias-tied": lambda: decoder(qkv_bias=True, tie_word_embeddings=True, sliding_window=6, sliding_layers=[1]),
    "learned-layernorm-gelu": lambda: decoder(positions="learned", norm="layernorm", mlp="gelu", activation="gelu"),
}


def prompt(T: int = 7, B: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_equal_a_full_forward(name):
    """Prefill, then one token at a time, then two at once: each call's logits equal the full forward's rows."""
    model = MODELS[name]()
    ids = prompt(12)
    with torch.no_grad():
        full = model(ids)  # (B, 12, V)
        cache = model.new_kv_cache(12)
        parts = [model(ids[:, :5], cache=cache), model(ids[:, 5:6], cache=cache), model(ids[:, 6:7], cache=cache),
                 model(ids[:, 7:9], cache=cache), model(ids[:, 9:], cache=cache)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("new_tokens", [5, 30])  # 30: past block_size (24), where the window slides
def test_generate_with_and_without_the_cache(name, new_tokens):
    model = MODELS[name]()
    ids = prompt()
    greedy = [generate(model, ids, new_tokens, temperature=0, use_cache=c) for c in (True, False)]
    assert torch.equal(greedy[0], greedy[1])
    sampled = [generate(model, ids, new_tokens, temperature=1.0, top_k=10, use_cache=c,
                        generator=torch.Generator().manual_seed(5)) for c in (True, False)]
    assert torch.equal(sampled[0], sampled[1])
    assert greedy[0].shape == (2, 7 + new_tokens)


def test_generate_uses_the_cache_one_token_a_step():
    """After the prompt, each call reads one token; past the context, the whole last window again."""
    model = minigpt()
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args[0].shape[1], "cache" in kwargs)),
                                    with_kwargs=True)
    generate(model, prompt(T=20), 8, temperature=0)  # 20 + 8 > BLOCK = 24: the last 4 steps read 24 tokens
    assert seen == [(20, True), (1, True), (1, True), (1, True), (1, True)] + [(24, False)] * 3


@pytest.mark.parametrize("T,new,B", [(BLOCK, 3, 1), (BLOCK + 3, 2, 3), (1, 1, 3), (5, 0, 2), (0, 0, 1)])
def test_generate_edges(T, new, B):
    """A prompt at or past the context, one token, no new tokens, an empty prompt, batches of 1 and 3."""
    model = MODELS["mistral-window"]()
    ids = prompt(T=T, B=B)
    out = generate(model, ids, new, temperature=0)
    assert out.shape == (B, T + new) and torch.equal(out[:, :T], ids)
    assert torch.equal(out, generate(model, ids, new, temperature=0, use_cache=False))


def test_the_cache_is_for_generation_only():
    model = minigpt()
    with pytest.raises(InputError, match="under torch.no_grad"):
        model(prompt(3), cache=model.new_kv_cache(8))  # autograd records: the in-place cache would break backward
    cache = model.new_kv_cache(8)
    with torch.no_grad():
        model(prompt(3, B=2), cache=cache)
        with pytest.raises(InputError, match="KV cache holds a batch of 2, got 3"):
            model(prompt(1, B=3), cache=cache)


def test_generate_stops_at_eos_with_the_cache():
    model = minigpt()
    ids = prompt()
    free = generate(model, ids, 10, temperature=0)
    eos = int(free[0, 9])  # the third token row 0 generates
    out = generate(model, ids, 10, temperature=0, eos_id=eos)
    assert torch.equal(out, generate(model, ids, 10, temperature=0, eos_id=eos, use_cache=False))


def test_lora_qlora_and_bf16_models_generate_the_same_with_the_cache():
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    for method, precision in (("lora", "fp32"), ("qlora", "fp32"), ("qlora", "bf16")):
        model = build_for_training(decoder(), method, LoRAConfig(r=2, alpha=4.0), device="cpu", precision=precision,
                                   allow_slow_bf16=True)
        for p in model.parameters():  # B = 0 at init: give the adapter something to say
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.1)
        model.eval()
        ids = prompt()
        with torch.no_grad():
            full = model(ids).float()
            cache = model.new_kv_cache(7)
            cached = torch.cat([model(ids[:, :4], cache=cache), model(ids[:, 4:5], cache=cache),
                                model(ids[:, 5:], cache=cache)], dim=1).float()
        tol = 1e-5 if precision == "fp32" else 5e-2  # bf16: other product shapes round differently
        torch.testing.assert_close(cached, full, rtol=0, atol=tol)
        if precision == "fp32":
            assert torch.equal(generate(model, ids, 8, temperature=0), generate(model, ids, 8, temperature=0,
                                                                                use_cache=False))


def test_the_cache_refuses_more_than_it_holds():
    model = minigpt()
    cache = model.new_kv_cache(4)
    with torch.no_grad():
        model(prompt(3), cache=cache)
        with pytest.raises(InputError, match="KV cache holds 4 positions: 3 stored, 2 more"):
            model(prompt(2), cache=cache)
    with pytest.raises(InputError, match="capacity"):
        KVCache(2, 0)
    cache = model.new_kv_cache(BLOCK + 5)
    with torch.no_grad():
        model(prompt(BLOCK), cache=cache)
        with pytest.raises(InputError, match="sequence length 25 exceeds block_size 24"):
            model(prompt(1), cache=cache)  # a position past the context


def test_attention_mask():
    assert attention_mask(1, 9, None, torch.device("cpu")) is None  # one new token sees every stored key
    assert attention_mask(1, 3, 5, torch.device("cpu")) is None  # the window does not cut in yet
    m = attention_mask(2, 3, 3, torch.device("cpu"))  # queries at positions 3, 4; window 3
    assert m.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]
    assert attention_mask(3, 0, None, torch.device("cpu")).tolist() == torch.ones(3, 3).tril().bool().tolist()

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigpt.base_folder import load_minigpt_folder, save_base
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT


def closed_form_params(c: GPTConfig) -> int:
    """Parameter count from the architecture alone (tied lm_head counted once)."""
    d, f, b = c.d_model, c.d_ff, int(c.bias)
    per_layer = (
        2 * (d + b * d)  # ln_1, ln_2
        + 4 * (d * d + b * d)  # q, k, v, o
        + (d * f + b * f)  # fc1
        + (f * d + b * d)  # fc2
    )
    embeddings = c.vocab_size * d + c.block_size * d
    head = 0 if c.tie_weights else c.vocab_size * d
    return embeddings + c.n_layer * per_layer + (d + b * d) + head


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_closed_form(bias, tie):
    c = GPTConfig(vocab_size=104, block_size=128, bias=bias, tie_weights=tie)
    assert sum(p.numel() for p in MiniGPT(c).parameters()) == closed_form_params(c)


def test_default_minigpt_size():
    c = GPTConfig(vocab_size=104, block_size=128)
    # 4 layers x (4·64·64 + 64·256 + 256·64 = 49,152 weights + biases and norms) + embeddings
    assert 4 * 64 * 64 + 64 * 256 + 256 * 64 == 49_152
    assert sum(p.numel() for p in MiniGPT(c).parameters()) == closed_form_params(c) == 214_912


@settings(max_examples=15, deadline=None)
@given(
    d_head=st.integers(1, 8), n_head=st.integers(1, 4), n_layer=st.integers(1, 3),
    vocab=st.integers(2, 50), block=st.integers(1, 20), bias=st.booleans(), tie=st.booleans(),
)
def test_param_count_random_configs(d_head, n_head, n_layer, vocab, block, bias, tie):
    c = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head,
                  d_model=d_head * n_head, bias=bias, tie_weights=tie)
    assert sum(p.numel() for p in MiniGPT(c).parameters()) == closed_form_params(c)


def test_module_names_are_the_contract(tiny_cfg):
    names = {n for n, _ in MiniGPT(tiny_cfg).named_modules()}
    for leaf in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc1", "mlp.fc2"):
        assert f"blocks.0.{leaf}" in names and f"blocks.1.{leaf}" in names


def test_tied_head_shares_storage(tiny_cfg):
    m = MiniGPT(tiny_cfg)
    assert m.lm_head.weight is m.wte.weight


def test_causality(tiny_cfg):
    torch.manual_seed(0)
    m = MiniGPT(tiny_cfg).eval()
    x = torch.randint(0, tiny_cfg.vocab_size, (2, 12))
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % tiny_cfg.vocab_size  # change only future tokens
    a, b = m(x), m(x2)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_save_load_round_trip_identical_logits(tmp_path, tiny_cfg):
    torch.manual_seed(0)
    m = MiniGPT(tiny_cfg).eval()
    save_base(m, None, tmp_path)
    m2, tok = load_minigpt_folder(tmp_path)
    x = torch.randint(0, tiny_cfg.vocab_size, (3, 16))
    assert tok is None
    assert torch.equal(m(x), m2(x))
    assert m2.lm_head.weight is m2.wte.weight


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_head=3, d_model=16), "does not divide"),
        (dict(block_size=0), "block_size"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(activation="relu6"), "activation"),
    ],
)
def test_bad_config_is_input_error(kwargs, message):
    base = dict(vocab_size=10, block_size=8, n_head=2, d_model=16)
    with pytest.raises(InputError, match=message):
        GPTConfig(**{**base, **kwargs})


def test_load_base_rejects_non_model_folder(tmp_path):
    with pytest.raises(InputError, match="not a model folder"):
        load_minigpt_folder(tmp_path)
    with pytest.raises(InputError, match="no such model folder"):
        load_minigpt_folder(tmp_path / "missing")


def test_generate_is_deterministic_and_respects_block(tiny_cfg):
    torch.manual_seed(0)
    m = MiniGPT(tiny_cfg)
    x = torch.zeros(2, 3, dtype=torch.long)
    a = m.generate(x, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    b = m.generate(x, 30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (2, 33) and torch.equal(a, b)
    greedy = m.generate(x, 5, temperature=0)
    assert greedy.shape == (2, 8)


def test_grad_checkpoint_is_a_switch_not_state():
    """model.grad_checkpoint changes neither module names nor the state dict, and the forward is the same."""
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, d_model=16))
    keys = list(model.state_dict())
    idx = torch.randint(40, (2, 8))
    plain = model(idx)
    model.grad_checkpoint = True
    assert list(model.state_dict()) == keys and "grad_checkpoint" not in model.config.to_dict()
    torch.testing.assert_close(model(idx), plain, rtol=0, atol=0)
    g_plain = torch.autograd.grad(plain.square().mean(), model.wte.weight)[0]
    g_ckpt = torch.autograd.grad(model(idx).square().mean(), model.wte.weight)[0]
    torch.testing.assert_close(g_ckpt, g_plain, rtol=1e-6, atol=1e-7)

"""minigpt.residual.add_then_norm: the residual add and the norm after it, fused where the norm offers it."""
import pytest
import torch
import torch.nn as nn

from minigpt import native_norm
from minigpt.decoder import signed_sin
from minigpt.residual import add_then_norm


def _case():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)


def test_a_plain_norm_gets_the_add_then_the_norm():
    x, branch = _case()
    norm = nn.LayerNorm(16)
    s, y = add_then_norm(x, branch, norm)
    assert torch.equal(s, x + branch) and torch.equal(y, norm(x + branch))


class _Offering(nn.LayerNorm):
    """A norm that offers the fused path: records each call, declines when told to."""

    def __init__(self, decline: bool) -> None:
        super().__init__(16)
        self.decline, self.calls = decline, 0

    def add_and_norm(self, x, branch):
        self.calls += 1
        return None if self.decline else ("fused", "result")


def test_a_norm_offering_add_and_norm_computes_both():
    x, branch = _case()
    norm = _Offering(decline=False)
    assert add_then_norm(x, branch, norm) == ("fused", "result") and norm.calls == 1


def test_a_norm_that_declines_gets_the_plain_ops():
    x, branch = _case()
    norm = _Offering(decline=True)
    s, y = add_then_norm(x, branch, norm)
    assert norm.calls == 1 and torch.equal(s, x + branch) and torch.equal(y, nn.LayerNorm.forward(norm, x + branch))


@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_a_norm_with_hooks_is_called_as_a_module(hook):
    """A hook on the norm (a memory probe, a cast) still runs: the fused path is skipped for it."""
    x, branch = _case()
    norm = _Offering(decline=False)
    seen = []
    if hook == "forward":
        norm.register_forward_hook(lambda m, args, out: seen.append(1))
    else:
        norm.register_forward_pre_hook(lambda m, args: seen.append(1))
    s, _ = add_then_norm(x, branch, norm)
    assert seen == [1] and norm.calls == 0 and torch.equal(s, x + branch)


@pytest.mark.skipif(native_norm.kernels() is None, reason="no C compiler or no AVX-512: the norm kernels are not used")
@pytest.mark.parametrize("family", ["minigpt", "decoder"])
def test_bf16_blocks_take_the_fused_add_and_train_to_the_same_bits(family, monkeypatch):
    """use_bf16_compute: each norm after a residual add does that add in C (a block's second norm, MiniGPT's ln_2
    or the decoder's post_attention_layernorm; the next block's first norm and the final norm, which add the MLP's
    output the block before left unadded); two optimizer steps give the same loss and LoRA factors, bit for bit,
    as the plain add followed by the norm."""
    from minigpt.train import lm_loss
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    def model():
        torch.manual_seed(0)
        if family == "minigpt":
            from minigpt.model import GPTConfig, MiniGPT
            m, targets = MiniGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)), ["q_proj", "fc2"]
        else:
            from minigpt.decoder import Decoder, DecoderConfig
            m = Decoder(DecoderConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64))
            targets = ["q_proj", "down_proj"]
        return build_for_training(m, "lora", LoRAConfig(r=4, alpha=8, target_modules=targets), device="cpu",
                                  compute_dtype=torch.float32, precision="bf16", allow_slow_bf16=True)

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def train(m):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(2):
            opt.zero_grad()
            loss = lm_loss(m, idx, idx)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in m.parameters() if p.requires_grad]

    calls = []
    real = native_norm._AddNormBf16.apply
    monkeypatch.setattr(native_norm._AddNormBf16, "apply", lambda *a: calls.append(1) or real(*a))
    fused = train(model())
    assert len(calls) == 2 * (2 * 2 + 1 - 1)  # each step: every norm of the 2 blocks and the final one, but the first
    plain = model()
    for m in plain.modules():
        if hasattr(m, "add_and_norm"):
            m.add_and_norm = lambda x, branch: None  # declines: the plain add, then the norm
    calls.clear()
    unfused = train(plain)
    assert calls == []
    assert fused[0] == unfused[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))


def _tiny(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "minigpt":
        from minigpt.model import GPTConfig, MiniGPT
        return MiniGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))
    from minigpt.decoder import Decoder, DecoderConfig
    return Decoder(DecoderConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=64))


def _blocks(m: nn.Module) -> list[nn.Module]:
    return list(m.blocks) if hasattr(m, "blocks") else list(m.model.layers)


@pytest.mark.parametrize("family", ["minigpt", "decoder"])
def test_blocks_in_halves_compute_what_the_blocks_compute(family):
    """The loop's halves (each block's last add left to the next norm) give the logits and gradients of calling
    each block whole, here where nothing fuses (fp32: the pending add is x + branch before the norm)."""
    m = _tiny(family)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    x = m.wte(idx) + m.wpe(torch.arange(16)) if family == "minigpt" else m.model.embed_tokens(idx)
    by_hand = x
    rope = None if family == "minigpt" else m.rope(16, x.device, x.dtype)
    for block in _blocks(m):
        by_hand = block(by_hand) if rope is None else block(by_hand, (rope[0], signed_sin(rope[1])))
    final = m.ln_f if family == "minigpt" else m.model.norm
    assert torch.equal(m(idx), m.lm_head(final(by_hand)))
    out = m(idx)
    out.square().mean().backward()
    halves = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    handles = [b.register_forward_pre_hook(lambda mod, args: None) for b in _blocks(m)]  # each block whole
    whole = m(idx)
    whole.square().mean().backward()
    for h in handles:
        h.remove()
    assert torch.equal(out, whole)
    assert all(torch.equal(a, p.grad) for a, p in zip(halves, m.parameters()))


@pytest.mark.parametrize("family", ["minigpt", "decoder"])
@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_a_block_with_hooks_of_its_own_runs_as_a_module(family, hook):
    """A hook on a block (the heap trim's pre-hook, a probe) still runs, with the block's whole output: the block
    before's pending add is made first (add_pending), and the block is called as a module."""
    from minigpt.residual import in_halves

    m = _tiny(family)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = m(idx)
    middle, seen = _blocks(m)[1], []
    assert in_halves(middle)
    if hook == "forward":
        middle.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    else:
        middle.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    assert not in_halves(middle)
    assert torch.equal(m(idx), expected)
    assert seen == [torch.Size([2, 16, 32])]

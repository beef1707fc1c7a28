"""minigpt.residual.add_then_norm: the residual add and the norm after it, fused where the norm offers it."""
import pytest
import torch
import torch.nn as nn

from minigpt import native_norm
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
    """use_bf16_compute: each block's second norm does the add before it in C (MiniGPT's ln_2, the decoder's
    post_attention_layernorm); two optimizer steps give the same loss and LoRA factors, bit for bit, as the
    plain add followed by the norm."""
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
    assert len(calls) == 2 * 2  # each block's second norm, each step
    plain = model()
    for m in plain.modules():
        if hasattr(m, "add_and_norm"):
            m.add_and_norm = lambda x, branch: None  # declines: the plain add, then the norm
    calls.clear()
    unfused = train(plain)
    assert calls == []
    assert fused[0] == unfused[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))

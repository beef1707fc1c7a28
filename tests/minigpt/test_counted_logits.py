"""The loss runs the head on the positions whose target counts only (minigpt.train.counted_logits): prompts and
padding of instruction data skip the head's product, and the loss and every gradient stay those of full logits."""
import pytest
import torch
from torch import nn

from minigpt.cross_entropy import cross_entropy
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import counted_logits, counted_loss, lm_loss
from minituner.build import build_for_training
from minituner.lora import LoRAConfig, lora_modules

IGNORE = -100
VOCAB = 541  # the bf16 head below casts 64 rows at a time (more values than the blocks' largest Linear)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def minigpt() -> nn.Module:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=16))


def decoder(tied: bool = False, **family) -> nn.Module:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                                 d_ff=64, tie_word_embeddings=tied, **family))


def masked_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt-and-padding pattern: each row's targets count from a different position to a different end."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (3, 12), generator=g), torch.randint(0, VOCAB, (3, 12), generator=g)
    pos = torch.arange(12)
    counts = (pos >= torch.tensor([[2], [5], [0]])) & (pos < torch.tensor([[12], [9], [4]]))
    return x, y.masked_fill(~counts, IGNORE)


def grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def nonzero_b(model: nn.Module) -> None:
    with torch.no_grad():  # a trained-looking adapter, so the LoRA path reaches every gradient
        for m in lora_modules(model).values():
            for b in m.lora_B.values():
                b.weight.normal_(std=0.1, generator=torch.Generator().manual_seed(2))


def head_rows_seen(model: nn.Module, run) -> list[int]:
    """The rows the head multiplies in each call while `run()` runs."""
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].size(-1)).size(0)))
    try:
        run()
    finally:
        handle.remove()
    return seen


QWEN2 = dict(model_type="qwen2", qkv_bias=True)
MISTRAL = dict(model_type="mistral", sliding_window=4, sliding_layers=[0, 1])
BUILDS = {  # the head trains in the full fine-tunes (LoRA never wraps an output head)
    "minigpt full": lambda: minigpt(),
    "llama full, untied": lambda: decoder(),
    "llama full, tied": lambda: decoder(tied=True),
    "qwen2 lora, grad checkpoint": lambda: _checkpointed(_built(decoder(**QWEN2), "lora", "all-linear")),
    "mistral sliding window lora": lambda: _built(decoder(**MISTRAL), "lora", "q_proj,v_proj"),
    "llama qlora": lambda: _built(decoder(tied=True), "qlora", "all-linear"),
    "bf16 llama lora, fp32 compute, chunked head": lambda: _built(decoder().to(torch.bfloat16), "lora", "all-linear"),
    "llama lora, bf16 compute (bf16 logits)": lambda: _built(decoder(), "lora", "all-linear", "bf16"),
}


def _built(model: nn.Module, method: str, targets: str, precision: str = "fp32") -> nn.Module:
    torch.manual_seed(3)
    build_for_training(model, method, LoRAConfig(r=4, alpha=8.0, target_modules=targets), device="cpu",
                       precision=precision, allow_slow_bf16=True)
    nonzero_b(model)
    return model


def _checkpointed(model: nn.Module) -> nn.Module:
    model.grad_checkpoint = True
    return model


@pytest.mark.parametrize("build", list(BUILDS))
def test_the_loss_and_every_gradient_equal_those_of_full_logits(build):
    model = BUILDS[build]()
    x, y = masked_batch()
    n = int((y != IGNORE).sum())
    full = cross_entropy(model(x), y)
    ref = grads(model, full)
    assert head_rows_seen(model, lambda: lm_loss(model, x, y)) == [n]  # the head ran on the counted rows alone
    loss = lm_loss(model, x, y)
    bf16 = "bf16 compute" in build  # logits in bf16: the two paths' products may round differently
    assert torch.allclose(loss, full, rtol=1e-3 if bf16 else 1e-6, atol=0)
    got = grads(model, loss)
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-2 if bf16 else 1e-5, atol=1e-5 if bf16 else 1e-7)


@pytest.mark.parametrize("make", [minigpt, decoder], ids=["minigpt", "decoder"])
def test_forward_with_keep_returns_the_kept_rows_of_the_full_logits_in_order(make):
    model = make()
    x, y = masked_batch()
    keep = y != IGNORE
    with torch.no_grad():
        kept = model(x, keep=keep)
        assert kept.shape == (int(keep.sum()), VOCAB)
        assert torch.allclose(kept, model(x)[keep], atol=1e-6)
        with pytest.raises(ValueError, match="bool mask"):  # indices would pick rows of the batch instead
            model(x, keep=keep.long())


def test_counted_logits_hands_back_full_logits_when_every_target_counts():
    class PlainLM(nn.Module):  # a forward(idx) with no keep argument: any model the loss took before
        def __init__(self):
            super().__init__()
            self.inner = minigpt()

        def forward(self, idx):
            return self.inner(idx)

    model = PlainLM()
    x, y = masked_batch()
    y = torch.where(y == IGNORE, x, y)
    logits, targets = counted_logits(model, x, y)
    assert targets is y and torch.equal(logits, model.inner(x))
    with pytest.raises(TypeError):  # a masked batch needs the keep argument
        counted_logits(model, *masked_batch())


def test_counted_loss_of_two_shards_is_the_batch_loss_with_the_head_on_counted_rows():
    model = minigpt()
    x, y = masked_batch()
    n = int((y != IGNORE).sum())
    shards = (slice(0, 1), slice(1, 3))  # torchrun's ranks: each weighs its sum by the global count
    with torch.no_grad():
        rows = head_rows_seen(model, lambda: [counted_loss(n, 2)(model, x[s], y[s]) for s in shards])
        assert rows == [int((y[s] != IGNORE).sum()) for s in shards]
        total = sum(counted_loss(n, 2)(model, x[s], y[s]) for s in shards) / 2
        assert torch.allclose(total, cross_entropy(model(x), y), rtol=1e-6)


def test_a_batch_where_nothing_counts_gives_nan_mean_and_zero_sum_as_full_logits_do():
    model = minigpt()
    x = torch.randint(0, VOCAB, (2, 5))
    y = torch.full((2, 5), IGNORE)
    assert torch.isnan(lm_loss(model, x, y)) and torch.isnan(cross_entropy(model(x), y))
    total = counted_loss(1, 1)(model, x, y)
    assert total.item() == 0.0
    model.zero_grad(set_to_none=True)
    total.backward()
    # every parameter still gets a gradient (a torchrun rank whose shard counts nothing joins the all-reduce)
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())

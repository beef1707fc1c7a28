"""A 16-bit checkpoint trained in fp32 (--precision fp32, CPU): block Linears, embeddings and head stay 16-bit
(minituner.upcast), the products run in fp32, and the numbers are those of the same model upcast whole."""
import copy

import pytest
import torch
from torch import nn

from minigpt.decoder import Decoder, DecoderConfig
from minigpt.train import lm_loss
from miniquant import QuantizedLinear
from miniquant.quantize import release_workspace, workspace_bytes
from minituner.build import build_for_training
from minituner.lora import LoRAConfig, LoRALinear, lora_modules
from minituner.precision import CastEmbedding, Bf16Linear, Fp32Linear
from minituner.upcast import RowChunkedUpcastFunction, UpcastLinear, compute_in_fp32
from minituner.qlora import cast_float_tensors
from minituner.zoo import adapters_disabled

CFG = dict(vocab_size=41, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64)


BIG_VOCAB = 541  # 541 x 32 is more than the blocks' largest Linear (64 x 32): the head casts 64 rows at a time


def _bf16_decoder(dtype=torch.bfloat16, tied=False, vocab=CFG["vocab_size"]) -> nn.Module:
    torch.manual_seed(0)
    cfg = DecoderConfig(**{**CFG, "vocab_size": vocab}, tie_word_embeddings=tied)
    return Decoder(cfg).to(dtype)  # as load_base reads a 16-bit folder


def _batch(vocab=CFG["vocab_size"]):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (3, 12), generator=g), torch.randint(0, vocab, (3, 12), generator=g)


def _nonzero_b(model):
    with torch.no_grad():  # a trained-looking adapter, so the LoRA path reaches every output and gradient
        for m in lora_modules(model).values():
            for b in m.lora_B.values():
                b.weight.normal_(std=0.1, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("targets,vocab", [("all-linear", CFG["vocab_size"]), ("q_proj,v_proj", CFG["vocab_size"]),
                                           ("all-linear", BIG_VOCAB)])
def test_lora_on_a_16bit_base_computes_the_upcast_models_numbers(dtype, tied, targets, vocab):
    low = _bf16_decoder(dtype, tied, vocab)
    ref = copy.deepcopy(low).float()  # the same weights, upcast whole (exact: every 16-bit value is an fp32 value)
    lora = LoRAConfig(r=4, alpha=8.0, target_modules=targets)
    for model in (low, ref):
        torch.manual_seed(3)  # the same fresh A
        build_for_training(model, "lora", lora, device="cpu")
    assert (low.lm_head.rows_per_product == 64) == (vocab == BIG_VOCAB)
    _nonzero_b(low)
    _nonzero_b(ref)
    x, y = _batch(vocab)
    loss_low, loss_ref = lm_loss(low, x, y), lm_loss(ref, x, y)
    loss_low.backward()
    loss_ref.backward()
    assert loss_low.dtype == torch.float32
    torch.testing.assert_close(loss_low, loss_ref, rtol=1e-6, atol=1e-6)
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads
    for n, p in low.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_linears_embeddings_and_head_stay_16bit_and_the_norms_become_fp32(tied):
    model = _bf16_decoder(torch.bfloat16, tied)
    weights = {n: m.weight for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)}
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0, target_modules="q_proj,v_proj"), device="cpu")
    for name, w in weights.items():  # targets (inside LoRALinear), the other Linears, the head, the embedding
        layer = model.get_submodule(name)
        layer = layer.base_layer if isinstance(layer, LoRALinear) else layer
        assert type(layer) in (UpcastLinear, CastEmbedding) and layer.weight is w  # not copied
        assert w.dtype == torch.bfloat16 and not w.requires_grad
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    assert model.model.embed_tokens(torch.tensor([[1, 2]])).dtype == torch.float32


@pytest.mark.parametrize("tied", [False, True])
def test_generation_upcasts_the_head_once(tied):
    model = compute_in_fp32(_bf16_decoder(torch.bfloat16, tied, BIG_VOCAB), head_16bit=False)
    assert type(model.lm_head) is Fp32Linear and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert type(model.model.layers[0].mlp.up_proj) is UpcastLinear


def test_the_chunked_head_reuses_the_blocks_workspace():
    release_workspace()
    model = _bf16_decoder(vocab=BIG_VOCAB)
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0), device="cpu")
    x, y = _batch(BIG_VOCAB)
    lm_loss(model, x, y).backward()
    assert workspace_bytes() == 4 * 64 * 32  # the largest block Linear's (d_ff x d_model) fp32, not the head's


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 7])
def test_row_chunked_products_equal_one_product(bias, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 6, generator=g).bfloat16()
    b = torch.randn(7, generator=g).bfloat16() if bias else None
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = RowChunkedUpcastFunction.apply(x, b, w, rows)
    y_ref = nn.functional.linear(x_ref, w.float(), None if b is None else b.float())
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn(4, 7, generator=g)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)


def test_backward_keeps_no_fp32_copy_of_a_weight():
    model = _bf16_decoder()
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0), device="cpu")
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is UpcastLinear}
    saved = []
    x, y = _batch()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        loss = lm_loss(model, x, y)
    assert not [s for s in saved if s[0] == torch.float32 and s[1] in shapes]  # the bf16 weight is saved, no copy
    assert (torch.bfloat16, next(iter(shapes))) in saved
    loss.backward()
    largest = max(a * b for a, b in shapes)
    assert workspace_bytes() >= 4 * largest  # the one fp32 buffer the casts share


def test_qlora_keeps_its_non_target_linears_16bit_too():
    model = _bf16_decoder()
    build_for_training(model, "qlora", LoRAConfig(r=4, alpha=8.0, target_modules="q_proj,v_proj"), device="cpu")
    kinds = {type(m.base_layer).__name__ for m in lora_modules(model).values()}
    assert kinds == {"QuantizedLinear"}
    assert type(model.model.layers[0].mlp.down_proj) is UpcastLinear
    assert all(type(m) is not nn.Linear or m.weight.dtype == torch.float32 for m in model.modules())


def test_precision_bf16_keeps_the_16bit_weights_as_read():
    # cast_float_tensors' `keep` once applied to the first module only: a bf16 checkpoint built for bf16 compute
    # was upcast whole to fp32 on the way (twice its memory) and copied back
    model = _bf16_decoder()
    ptrs = {n: m.weight.data_ptr() for n, m in model.named_modules() if type(m) is nn.Linear and "layers" in n}
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0), device="cpu", precision="bf16",
                       compute_dtype=torch.float32, allow_slow_bf16=True)
    for name, ptr in ptrs.items():
        layer = model.get_submodule(name).base_layer
        assert type(layer) is Bf16Linear and layer.weight.data_ptr() == ptr


def test_cast_float_tensors_keeps_every_module_of_the_kept_types():
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    cast_float_tensors(model, torch.float32, keep=(nn.Linear,))
    assert model[0].weight.dtype == torch.float32
    assert model[1].weight.dtype == model[2].weight.dtype == torch.bfloat16


def test_an_input_in_another_dtype_computes_in_the_weights():
    layer = UpcastLinear(8, 4).to(torch.bfloat16)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    torch.testing.assert_close(layer(x.float()), nn.functional.linear(x.float(), layer.weight.float(),
                                                                      layer.bias.float()), rtol=1e-6, atol=1e-6)


def test_adapters_disabled_gives_the_base_output_and_restores_them():
    model = _bf16_decoder(torch.float32)
    base = copy.deepcopy(model)
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0), device="cpu")
    _nonzero_b(model)
    x, _ = _batch()
    with torch.no_grad():
        with_adapter = model(x)
        with adapters_disabled(model):
            torch.testing.assert_close(model(x), base(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(model(x), with_adapter)
    assert not any(m.disabled for m in lora_modules(model).values())
    assert not isinstance(model.model.layers[0].self_attn.q_proj.base_layer, QuantizedLinear)


def test_merge_in_place_is_refused_on_a_16bit_base_and_merged_linear_works():
    from minigpt.errors import InputError

    model = _bf16_decoder()
    build_for_training(model, "lora", LoRAConfig(r=4, alpha=8.0, target_modules="q_proj"), device="cpu")
    _nonzero_b(model)
    layer = model.model.layers[0].self_attn.q_proj
    before = layer.base_layer.weight.clone()
    with pytest.raises(InputError, match="unmerge would not restore it exactly"):
        layer.merge()  # W + ΔW rounded to bf16 and back would not give W again
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged_adapters
    merged = layer.merged_linear()
    torch.testing.assert_close(merged.weight.float(), (before.float() + layer.delta_weight()).bfloat16().float())


@pytest.mark.parametrize("tied", [False, True])
def test_generation_upcasts_the_block_linears_once_where_the_copy_fits(tied):
    """generate --precision fp32: the block Linears fp32 once where their copy (2 bytes a value more) takes at most
    half the memory available, else cast per product; the same logits either way, a LoRA on them included."""
    from minituner.lora import apply_lora
    from minituner.upcast import compute_in_fp32_for_generation

    base = _bf16_decoder(tied=tied)
    apply_lora(base, LoRAConfig(r=2, alpha=4, target_modules=["q_proj", "down_proj"]))
    for m in lora_modules(base).values():
        torch.nn.init.normal_(m.lora_B["default"].weight)
    extra = 2 * sum(m.weight.numel() for n, m in base.named_modules()
                    if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and n != "lm_head")
    once, per_product = copy.deepcopy(base), copy.deepcopy(base)
    assert compute_in_fp32_for_generation(once, 2 * extra) is True
    assert compute_in_fp32_for_generation(per_product, 2 * extra - 1) is False
    assert not any(isinstance(m, UpcastLinear) for m in once.modules())
    assert all(m.weight.dtype == torch.float32 for m in once.modules() if isinstance(m, nn.Linear))
    assert sum(isinstance(m, UpcastLinear) for m in per_product.modules()) == 2 * 7  # q, k, v, o, gate, up, down
    x = torch.randint(0, CFG["vocab_size"], (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(once.eval()(x), per_product.eval()(x), rtol=1e-5, atol=1e-5)
        expected = base.float().eval()(x)
    torch.testing.assert_close(once(x), expected, rtol=1e-5, atol=1e-5)

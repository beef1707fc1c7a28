"""bf16 compute (minituner.precision): bf16 frozen base, fp32 masters, norms and loss; against an fp32 reference."""
import copy

import pytest
import torch
from torch import nn

from minigpt.cross_entropy import cross_entropy
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from miniquant import QuantizedLinear
from minituner.lora import LoRAConfig, apply_lora, lora_modules
from minikernels import fp32_gemm
from minituner.precision import (CastEmbedding, Bf16Linear, Fp32Linear, compute_dtypes, use_bf16_compute,
                                  use_fp32_products)
from minituner.build import wrap_minigpt_qlora

CFG = dict(vocab_size=37, block_size=16, n_layer=2, n_head=2, d_model=32)
LOSS_RTOL = 2e-3  # bf16 keeps 8 significant bits; the loss is a mean over many tokens
GRAD_RTOL = 6e-2  # relative Frobenius error of each LoRA gradient (products and casts in bf16)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _model(kind: str, device: str = "cpu", targets="all-linear") -> nn.Module:
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(**CFG))
    if kind == "lora":
        apply_lora(model, LoRAConfig(r=4, alpha=8.0, target_modules=targets))
        model.to(device)
    else:
        wrap_minigpt_qlora(model, r=4, alpha=8.0, targets=targets, device=device, compute_dtype=torch.float32)
    with torch.no_grad():  # a non-zero B, so the LoRA path contributes to the output and to every gradient
        for m in lora_modules(model).values():
            for b in m.lora_B.values():
                b.weight.normal_(std=0.1)
    return model


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG["vocab_size"], (4, CFG["block_size"]), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (4, CFG["block_size"]), generator=g)
    return x.to(device), y.to(device)


def _loss(model, x, y):
    logits = model(x)  # (B, T, V): bf16 from a bf16 head, which reads the final norm's bf16 output
    assert logits.dtype == (torch.bfloat16 if isinstance(model.lm_head, Bf16Linear) else torch.float32)
    return cross_entropy(logits, y)  # as lm_loss: F.cross_entropy on fp32 logits, in fp32 chunks on bf16


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_loss_and_lora_grads_match_fp32(kind, device):
    ref = _model(kind, device)
    bf = use_bf16_compute(copy.deepcopy(ref))
    x, y = _batch(device)
    loss_ref, loss_bf = _loss(ref, x, y), _loss(bf, x, y)
    loss_ref.backward()
    loss_bf.backward()
    assert abs(loss_bf.item() - loss_ref.item()) <= LOSS_RTOL * loss_ref.item()
    g_ref, g_bf = _grads(ref), _grads(bf)
    assert g_ref.keys() == g_bf.keys() and all("lora_" in n for n in g_bf)
    for n in g_ref:
        assert g_bf[n].dtype == torch.float32, n
        err = float((g_bf[n] - g_ref[n]).norm() / g_ref[n].norm())
        assert err < GRAD_RTOL, f"{n}: relative gradient error {err:.3g}"


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_dtypes_after_conversion(kind):
    model = use_bf16_compute(_model(kind))
    expected = {"embeddings": "bfloat16", "norms": "float32", "LoRA compute": "bfloat16", "LoRA masters": "float32",
                "frozen linear weights": "bfloat16"}  # lm_head (and, for LoRA, the wrapped bases)
    if kind == "qlora":
        expected["quantized linear compute"] = "bfloat16"
    assert compute_dtypes(model) == expected
    assert isinstance(model.wte, CastEmbedding) and isinstance(model.lm_head, Bf16Linear)
    assert model.lm_head.weight is model.wte.weight  # still tied: one bf16 tensor
    assert model.wte(torch.tensor([[1, 2]])).dtype == torch.float32
    seen = _dtypes_seen(model, {"ln_1": model.blocks[0].ln_1, "attn": model.blocks[0].attn,
                                "fc2": model.blocks[0].mlp.fc2, "block": model.blocks[0]})
    assert seen == {"ln_1 in": torch.float32, "ln_1 out": torch.bfloat16,  # the norm reads the fp32 stream
                    "attn in": torch.bfloat16, "attn out": torch.bfloat16,  # bf16 from the norm to the residual add
                    "fc2 in": torch.bfloat16, "fc2 out": torch.bfloat16,
                    "block in": torch.float32, "block out": torch.float32, "logits": torch.bfloat16}


def _dtypes_seen(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, torch.dtype]:
    """The dtype of each module's first input and its output in one forward (hooks registered after ours)."""
    seen = {}
    for name, m in modules.items():
        m.register_forward_hook(lambda m, a, out, name=name: seen.update({f"{name} in": a[0].dtype,
                                                                           f"{name} out": out.dtype}))
    seen["logits"] = model(_batch()[0]).dtype
    return seen


def test_decoder_dataflow_in_bf16():
    """Llama-family: RMSNorm reads the fp32 stream and hands bf16 on; RoPE, attention and SwiGLU run in bf16."""
    from minigpt.decoder import Decoder, DecoderConfig

    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                                  d_ff=64))
    apply_lora(model, LoRAConfig(r=4, alpha=8.0, target_modules="all-linear"))
    use_bf16_compute(model)
    assert model.compute_dtype == torch.bfloat16
    layer = model.model.layers[0]
    seen = _dtypes_seen(model, {"norm": layer.input_layernorm, "attn": layer.self_attn, "down": layer.mlp.down_proj,
                                "layer": layer})
    assert seen == {"norm in": torch.float32, "norm out": torch.bfloat16, "attn in": torch.bfloat16,
                    "attn out": torch.bfloat16, "down in": torch.bfloat16, "down out": torch.bfloat16,
                    "layer in": torch.float32, "layer out": torch.float32, "logits": torch.bfloat16}
    cos, sin = model.rope(16, torch.device("cpu"), model.compute_dtype)
    assert cos.dtype == sin.dtype == torch.bfloat16


def test_step_zero_output_equals_the_bf16_base():
    """B = 0: the LoRA path adds exactly nothing, in bf16 too."""
    torch.manual_seed(0)
    base = MiniGPT(GPTConfig(**CFG)).requires_grad_(False)
    lora = copy.deepcopy(base)
    apply_lora(lora, LoRAConfig(r=4, alpha=8.0))
    x, _ = _batch()
    assert torch.equal(use_bf16_compute(lora)(x), use_bf16_compute(base)(x))


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_an_adamw_step_changes_only_the_lora_masters(kind):
    model = use_bf16_compute(_model(kind))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    masters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, y = _batch()
    _loss(model, x, y).backward()
    opt.step()
    for k, v in model.state_dict().items():
        if k in frozen:
            assert torch.equal(v, frozen[k]), f"frozen {k} changed"
    for n, p in model.named_parameters():
        if n in masters:
            assert p.dtype == torch.float32 and not torch.equal(p, masters[n]), n
    for state in opt.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_lora_on_some_targets_leaves_other_linears_bf16_returning_their_input_dtype():
    model = use_bf16_compute(_model("qlora", targets=["q_proj", "v_proj"]))
    fc1 = model.blocks[0].mlp.fc1
    assert isinstance(fc1, Bf16Linear) and fc1.bias.dtype == torch.bfloat16
    assert fc1(torch.randn(3, 32)).dtype == torch.float32 and fc1(torch.randn(3, 32).bfloat16()).dtype == torch.bfloat16
    assert model.lm_head(torch.randn(3, 32).bfloat16()).dtype == torch.bfloat16  # bf16 logits: the loss upcasts
    q = model.blocks[0].attn.q_proj.base_layer
    assert isinstance(q, QuantizedLinear) and q.compute_dtype == torch.bfloat16 and q.bias.dtype == torch.bfloat16
    x, y = _batch()
    _loss(model, x, y).backward()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.grad is not None}


def test_full_fine_tuning_is_refused():
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(**CFG))
    with pytest.raises(InputError, match=r"frozen base.*full fine-tuning trains in fp32"):
        use_bf16_compute(model)
    assert type(model.lm_head) is nn.Linear and model.wte.weight.dtype == torch.float32  # nothing changed


def test_idempotent_and_disabled_adapters():
    model = use_bf16_compute(_model("lora"))
    params = {n: p for n, p in model.named_parameters()}
    use_bf16_compute(model)
    assert {n: p for n, p in model.named_parameters()}.keys() == params.keys()
    assert all(params[n] is p for n, p in model.named_parameters())
    layer = model.blocks[0].attn.q_proj
    layer.disabled = True
    x = torch.randn(2, 5, 32)
    assert layer(x).dtype == torch.float32
    assert torch.equal(layer(x), layer.base_layer(x))


def test_a_model_in_bf16_compute_pickles_and_refuses_another_low_dtype(tmp_path):
    import io

    model = use_bf16_compute(_model("qlora"))
    x, _ = _batch()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the norms' hooks are module-level functions
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    assert torch.equal(again(x), model(x))
    with pytest.raises(InputError, match="already computes in torch.bfloat16"):
        use_bf16_compute(model, dtype=torch.float16)
    assert {m.compute_dtype for m in lora_modules(model).values()} == {torch.bfloat16}  # nothing changed


def test_unsupported_dtype_is_refused():
    with pytest.raises(InputError, match="bfloat16 or float16"):
        use_bf16_compute(_model("lora"), dtype=torch.float64)


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_every_matrix_product_of_a_step_runs_in_bf16(kind):
    """Forward and backward: no fp32 product is left (attention's fused kernel is not a product)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
                torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}
    dtypes = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    model = use_bf16_compute(_model(kind))
    x, y = _batch()
    with Record():
        _loss(model, x, y).backward()
    assert dtypes == {torch.bfloat16}


def test_merge_is_refused_under_bf16_compute():
    model = use_bf16_compute(_model("lora"))
    with pytest.raises(InputError, match="cannot merge under torch.bfloat16 compute"):
        model.blocks[0].attn.q_proj.merge()
    assert not model.blocks[0].attn.q_proj.merged_adapters


def test_a_model_already_cast_to_bf16_is_refused():
    """wrap_minigpt_qlora's compute_dtype=bf16 casts the norms too; use_bf16_compute keeps them fp32, so it wants fp32."""
    torch.manual_seed(0)
    model = wrap_minigpt_qlora(MiniGPT(GPTConfig(**CFG)), r=4, device="cpu", compute_dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"starts from an fp32 model .* is not fp32"):
        use_bf16_compute(model)


def test_apply_precision_checks_the_cpu_then_converts():
    from minituner.precision import apply_precision

    model = _model("lora")
    assert apply_precision(model, "fp32") is None and isinstance(model.lm_head, nn.Linear)
    with pytest.raises(InputError, match="no bf16 units.*--precision fp32"):
        apply_precision(model, "bf16", "cpu", flags={"avx2", "avx512f"})
    assert type(model.lm_head) is nn.Linear  # refused: nothing changed
    support = apply_precision(model, "bf16", "cpu", allow_slow_bf16=True, flags={"avx2"})
    assert not support.fast and isinstance(model.lm_head, Bf16Linear)
    assert apply_precision(_model("qlora"), "bf16", "cpu", flags={"avx512_bf16"}).fast
    with pytest.raises(InputError, match="precision must be one of fp32, bf16"):
        apply_precision(model, "bf16-autocast")
    full = MiniGPT(GPTConfig(**CFG))
    with pytest.raises(InputError, match="full fine-tuning trains in fp32"):
        apply_precision(full, "bf16", "cpu", flags={"avx512_bf16"})


@pytest.mark.parametrize("backend", ["onednn", "aten"])
def test_fp32_products_swap_the_linears_but_the_factors_and_keep_the_numbers(backend, monkeypatch):
    monkeypatch.setattr(fp32_gemm, "backend", lambda: backend)
    model = _model("lora", targets="q_proj,fc1")
    model.blocks[1].mlp.fc2.weight.requires_grad_(True)  # a trainable Linear: its weight's gradient too
    reference = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    assert use_fp32_products(model) is model
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects: nothing copied
    assert type(model.lm_head) is Fp32Linear and model.lm_head.weight is model.wte.weight  # still tied
    assert type(model.blocks[0].attn.k_proj) is Fp32Linear and type(model.blocks[1].mlp.fc2) is Fp32Linear
    for m in lora_modules(model).values():
        assert type(m.base_layer) is Fp32Linear
        assert all(type(f) is nn.Linear for d in (m.lora_A, m.lora_B) for f in d.values())  # the factors
    modules = dict(model.named_modules())
    use_fp32_products(model)  # idempotent
    assert all(a is b for a, b in zip(modules.values(), dict(model.named_modules()).values()))
    x, y = _batch()
    loss, ref_loss = _loss(model, x, y), _loss(reference, x, y)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in _grads(reference).items():
        torch.testing.assert_close(_grads(model)[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["onednn", "aten"])
def test_a_full_fine_tune_trains_through_fp32_products_with_the_same_gradients(backend, monkeypatch):
    """build_for_training(..., "full") swaps every Linear (the tied head too); each gradient is F.linear's."""
    from minituner.build import build_for_training

    monkeypatch.setattr(fp32_gemm, "backend", lambda: backend)
    torch.manual_seed(0)
    reference = MiniGPT(GPTConfig(**CFG))
    model = build_for_training(copy.deepcopy(reference), "full", device="cpu")
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert model.lm_head.weight is model.wte.weight  # still tied
    reference.requires_grad_(True)
    x, y = _batch()
    loss, ref_loss = _loss(model, x, y), _loss(reference, x, y)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    grads, ref_grads = _grads(model), _grads(reference)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


def test_stored_precision_counts_the_base_not_an_adapters_factors():
    """A QLoRA model's float parameters are few (embedding, norms, head): a large rank's fp32 factors must not make a
    bf16 checkpoint read as fp32 (generate --precision auto would then pick fp32)."""
    from minituner.precision import stored_precision

    model = MiniGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=32)).to(torch.bfloat16)
    assert stored_precision(model) == "bf16"
    apply_lora(model, LoRAConfig(r=32, alpha=32, target_modules="all-linear"))  # fp32 factors outnumber the base
    lora_values = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora_values > sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert stored_precision(model) == "bf16"
    assert stored_precision(model.float()) == "fp32"


def test_a_bf16_training_head_keeps_its_logits_unless_the_model_checkpoints():
    """keep_head_output: the head (only it) gets an OutputStore before each forward, dropped while the model
    checkpoints its blocks; build_for_training installs it for bf16 on CPU, once."""
    from minituner.build import build_for_training
    from minituner.precision import Bf16Linear, keep_head_output, kept_output_bytes

    cfg = GPTConfig(vocab_size=8192, block_size=1024, n_layer=1, n_head=2, d_model=32)
    model = build_for_training(MiniGPT(cfg), "lora", device="cpu", precision="bf16", allow_slow_bf16=True)
    assert keep_head_output(model) == 0  # installed once already
    assert isinstance(model.lm_head, Bf16Linear)
    idx = torch.randint(0, cfg.vocab_size, (2, 1024))  # 2,048 x 8,192 bf16 logits: 32 MiB

    def step():
        logits = model(idx)
        ptr = logits.data_ptr()
        logits.float().mean().backward()
        return ptr

    first = step()
    assert step() == first and kept_output_bytes(model) == 2048 * 8192 * 2
    assert [n for n, m in model.named_modules() if "_output_store" in m.__dict__] == ["lm_head"]
    model.grad_checkpoint = True
    step()
    assert kept_output_bytes(model) == 0
    model.grad_checkpoint = False
    again = step()
    assert step() == again and kept_output_bytes(model) == 2048 * 8192 * 2

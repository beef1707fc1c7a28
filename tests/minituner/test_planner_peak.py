"""The planner's step peak (planner/peak.py): its terms on tiny configs, and the phase it picks."""
from __future__ import annotations

import pytest

from minigpt import native_loss
from minigpt.bf16_support import Bf16Support
from minigpt.cross_entropy import chunk_rows
from minigpt.model import GPTConfig
from minituner.planner import MemoryConfig, Regime, minigpt_shape, preset_shape, regime_bytes
from minituner.planner import activations
from minituner.hf_config import decoder_config_from_hf
from minituner.planner.activations import PRECISION_WIDTHS, minigpt_activation_bytes, minigpt_saved_by_layer
from minituner.planner.hf import decoder_shape
from minituner.planner.peak import PEAK_MODELS, has_peak_model, step_peak

TINY = dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, d_model=16)
TINY_LLAMA = {"model_type": "llama", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}
B, T = 2, 8
N = B * T


def buckets(shape, regime, **kw):
    cfg = MemoryConfig(batch_size=B, seq_len=T, full_precision="fp32", activations="exact", dtype="fp32", **kw)
    return regime_bytes(shape, regime, "all-linear", cfg)


def phases(shape, regime, rank=None, ckpt=False):
    b = buckets(shape, Regime(regime, rank), grad_checkpoint=ckpt)
    return step_peak(shape, regime, rank, "all-linear", B, T, 4, ckpt, weights=b.weights, grads=b.grads,
                     optimizer=b.optimizer), b


def test_loss_terms_are_the_logits():
    shape = minigpt_shape(GPTConfig(**TINY))
    peak, b = phases(shape, "lora", 4)
    V = shape.vocab_size
    assert peak.phases["forward (loss)"]["logits"] == N * V * 4
    assert peak.phases["backward: loss"]["nll and log-softmax gradients (N x V, fp32)"] == 2 * N * V * 4
    assert sum(peak.phases["backward: loss"].values()) == b.weights + b.optimizer + b.activations + 2 * N * V * 4
    # the previous step's grads are alive in the forward (zero_grad comes after it), not in the backward
    assert peak.phases["forward (loss)"]["grads (last step's; zero_grad follows the forward)"] == b.grads


def test_large_fp32_logits_are_planned_chunked_and_in_place(monkeypatch):
    """Past minigpt.cross_entropy's FP32_CHUNKED_MIN_VALUES the loss keeps the logits (not a log-softmax), the
    forward adds one chunk's logsumexp copy and the backward makes nothing (N, V)."""
    from minigpt import cross_entropy

    monkeypatch.setattr(cross_entropy, "FP32_CHUNKED_MIN_VALUES", 1)
    shape = minigpt_shape(GPTConfig(**TINY))
    peak, b = phases(shape, "lora", 4)
    V = shape.vocab_size
    rows = min(N, cross_entropy.chunk_rows(V))
    assert peak.phases["forward (loss)"]["loss chunk (logsumexp's shifted copy)"] == rows * V * 4
    assert "logits" not in peak.phases["forward (loss)"]
    assert sum(peak.phases["backward: loss"].values()) == b.weights + b.optimizer + b.activations


def test_peak_is_the_largest_phase_and_lands_in_buckets():
    shape = minigpt_shape(GPTConfig(**TINY))
    for regime, rank in (("full", None), ("lora", 4), ("qlora", 4)):
        peak, b = phases(shape, regime, rank)
        assert peak.bytes == max(sum(v.values()) for v in peak.phases.values())
        assert (b.peak, b.peak_phase) == (peak.bytes, peak.phase)
        assert b.peak >= b.weights + b.optimizer + b.activations


def test_full_ft_embedding_temporaries_and_an_optimizer_step_without_any():
    shape = minigpt_shape(GPTConfig(**{**TINY, "vocab_size": 1000}))  # V x C is the largest tensor
    peak, b = phases(shape, "full")
    assert peak.phases["backward: embeddings"]["embedding gradient temporaries"] == 1000 * 16 * 4  # tied
    untied = minigpt_shape(GPTConfig(**{**TINY, "vocab_size": 1000, "tie_weights": False}))
    assert phases(untied, "full")[0].phases["backward: embeddings"]["embedding gradient temporaries"] == 0
    for regime in ("full", "lora", "qlora"):  # fused AdamW updates in place: weights, grads and its state only
        peak_r, b_r = phases(shape, regime, None if regime == "full" else 4)
        step = dict(peak_r.phases["optimizer step"])
        workspace = sum(step.pop(k) for k in [k for k in step if k.endswith("workspace")])
        assert step == {"weights": b_r.weights, "optimizer state": b_r.optimizer, "grads": b_r.grads}, regime
        assert (workspace > 0) == (regime == "qlora")


def test_qlora_holds_the_dequantization_workspace_in_every_phase():
    shape = minigpt_shape(GPTConfig(**TINY))
    peak, _ = phases(shape, "qlora", 4)
    for phase, terms in peak.phases.items():  # one buffer of the largest weight (fc1/fc2), fp32, kept all step
        assert terms["NF4 dequantization workspace"] == 16 * 64 * 4, phase
    lora, _ = phases(shape, "lora", 4)
    assert not any("workspace" in term for terms in lora.phases.values() for term in terms)


def test_a_16bit_base_in_fp32_shares_one_workspace_for_its_upcast_and_nf4_linears():
    shape = minigpt_shape(GPTConfig(**TINY))  # attention 16 x 16, MLP 16 <-> 64
    b = buckets(shape, Regime("lora", 4))

    every = {lin.path for lin in shape.linears}

    def terms(regime, targets, upcast=every):
        peak = step_peak(shape, regime, 4, targets, B, T, 4, weights=b.weights, grads=b.grads, optimizer=b.optimizer,
                         upcast=upcast)
        return {t: v for terms in peak.phases.values() for t, v in terms.items() if "workspace" in t}

    assert terms("lora", "q_proj") == {"16-bit upcast workspace": 16 * 64 * 4}  # every block Linear, targeted or not
    assert terms("qlora", "all-linear") == {"NF4 dequantization workspace": 16 * 64 * 4}  # nothing left 16-bit
    assert terms("qlora", "q_proj") == {"NF4 dequantization and 16-bit upcast workspace": 16 * 64 * 4}
    assert terms("full", "all-linear") == {}  # full fine-tuning reads the base in fp32
    # a checkpoint mixing dtypes: only its 16-bit Linears are upcast, and the workspace is the largest of those
    assert terms("lora", "q_proj", {"attn.q_proj", "attn.v_proj"}) == {"16-bit upcast workspace": 16 * 16 * 4}
    assert terms("lora", "q_proj", ()) == {}  # an fp32 base


def test_grad_checkpoint_keeps_block_inputs_and_recomputes_one_block():
    shape = minigpt_shape(GPTConfig(**TINY))
    plain = minigpt_saved_by_layer(shape, B, T, "lora", 4)
    ckpt = minigpt_saved_by_layer(shape, B, T, "lora", 4, grad_checkpoint=True)
    assert ckpt.blocks == ({"checkpointed block input": N * 16 * 4},) * 2
    assert ckpt.head == plain.head and ckpt.embed == plain.embed
    assert plain.total() == minigpt_activation_bytes(shape, B, T, "lora", 4)
    peak, b = phases(shape, "lora", 4, ckpt=True)
    assert b.activations == ckpt.total()
    assert peak.phases["backward: last block"]["recomputed block's saved tensors"] == sum(plain.blocks[-1].values())


def test_every_family_has_a_peak_model_but_estimates_have_no_peak():
    llama = preset_shape("llama-7b")
    assert has_peak_model(llama) and {"llama", "mistral", "qwen2"} <= set(PEAK_MODELS)
    b = regime_bytes(llama, Regime("lora", 8), "all-linear", MemoryConfig(activations="korthikanti"))
    assert b.peak is None and "peak" not in b.to_dict()  # an estimate has no per-layer model, so no peak
    mini = regime_bytes(minigpt_shape(GPTConfig(**TINY)), Regime("lora", 8), "all-linear", MemoryConfig())
    assert mini.peak is None  # the seed's estimate (Lab 01's) has no peak: it has no per-layer model


def test_half_logits_are_never_fp32_in_the_loss(monkeypatch):
    """Half-width logits go to minigpt.cross_entropy's chunks: fp32 temporaries of a chunk's rows, never (N, V);
    their gradient is written over them (overwrite_logits), so the loss's backward makes no (N, V) tensor."""
    shape = minigpt_shape(GPTConfig(**TINY))
    V = shape.vocab_size
    b = buckets(shape, Regime("lora", 4))
    peak = step_peak(shape, "lora", 4, "all-linear", B, T, 2, False, weights=b.weights, grads=b.grads,
                     optimizer=b.optimizer)  # 16-bit throughout (fp16 or bf16): the PyTorch ops
    rows = min(N, chunk_rows(V))
    assert "logits" not in peak.phases["forward (loss)"]  # in the activations: the logits the loss keeps
    assert peak.phases["forward (loss)"]["loss chunk (fp32 copy and logsumexp's shifted copy)"] == 2 * rows * V * 4
    assert peak.phases["backward: loss"] == {**{k: v for k, v in peak.phases["backward: loss"].items()
                                                if k != "loss chunk (fp32 softmax)"},
                                             "loss chunk (fp32 softmax)": rows * V * 4}
    assert not any("logit" in k for k in peak.phases["backward: loss"])
    assert peak.phases["backward: head"]["logit gradient (N x V)"] == N * V * 2  # where the loss kept the logits
    bf16 = {**PRECISION_WIDTHS["bf16"], "weights": b.weights, "grads": b.grads, "optimizer": b.optimizer}
    for built in (True, False):  # bf16 compute on a CPU: minigpt.native_loss a row at a time, where it is built
        monkeypatch.setattr(native_loss, "takes_bf16_logits", lambda: built)
        phases = step_peak(shape, "lora", 4, "all-linear", B, T, **bf16).phases
        assert any("loss chunk" in k for phase in phases.values() for k in phase) is not built
        assert phases["backward: head"]["logit gradient (N x V)"] == N * V * 2
    cuda = step_peak(shape, "lora", 4, "all-linear", B, T, **bf16, on_cpu=False).phases  # the PyTorch ops
    assert "loss chunk (fp32 softmax)" in cuda["backward: loss"]


def cpu_bf16_units(monkeypatch, present: bool) -> None:
    """The planner's view of this CPU: with bf16 units (avx512_bf16) or without (bf16 only under --allow-slow-bf16)."""
    found = Bf16Support(True, ("avx512_bf16",), "mocked") if present else Bf16Support(False, (), "mocked")
    monkeypatch.setattr(activations, "bf16_support", lambda device="cpu": found)


@pytest.fixture
def bf16_units(monkeypatch):
    cpu_bf16_units(monkeypatch, True)


def test_bf16_compute_terms_are_in_their_dtypes(bf16_units):
    """bf16 compute: bf16 logits kept by the loss and their bf16 gradient, the residual stream's gradient fp32 and
    the MLP's bf16, the dequantization workspace in bf16; A at bf16's widths."""
    shape = minigpt_shape(GPTConfig(**TINY))
    V, C, F = shape.vocab_size, 16, 64
    b = buckets(shape, Regime("qlora", 4))
    widths = PRECISION_WIDTHS["bf16"]
    peak = step_peak(shape, "qlora", 4, "all-linear", B, T, weights=b.weights, grads=b.grads, optimizer=b.optimizer,
                     **widths)
    saved = minigpt_saved_by_layer(shape, B, T, "qlora", 4, **widths)
    assert peak.phases["forward (loss)"]["activations"] == saved.total()
    assert saved.head["logits kept by the loss"] == N * V * 2 and saved.head["loss logsumexp"] == N * 4
    head = peak.phases["backward: head"]
    assert head["logit gradient (N x V)"] == N * V * 2 and head["head input gradient"] == N * C * 2
    assert head["activations (what the loss kept freed)"] == saved.total() - N * V * 2 - N * 4
    block = peak.phases["backward: last block"]
    assert block["residual and MLP gradients"] == N * C * 4 + N * F * 2
    assert block["NF4 dequantization workspace"] == 16 * 64 * 2


@pytest.mark.parametrize("family", ["minigpt", "llama"])
def test_bf16_without_units_counts_the_fallback_products_fp32_buffer(monkeypatch, family):
    """On a CPU without bf16 units PyTorch's bf16 product for LoRA's input gradient (N, in) computes into an fp32
    buffer of its output's size: the last block's backward holds the widest target's gradient and that buffer
    beside the residual gradient, when that moment is the larger; with units, the block's usual terms."""
    shape = minigpt_shape(GPTConfig(**TINY)) if family == "minigpt" else decoder_shape(decoder_config_from_hf(TINY_LLAMA))
    b = buckets(shape, Regime("lora", 4))
    widths = PRECISION_WIDTHS["bf16"]

    def block(present):
        cpu_bf16_units(monkeypatch, present)
        return step_peak(shape, "lora", 4, "all-linear", B, T, weights=b.weights, grads=b.grads, optimizer=b.optimizer,
                         **widths).phases["backward: last block"]

    with_units, without = block(True), block(False)
    widest = max(lin.in_features for lin in shape.linears if "lm_head" not in lin.path)  # fc2's / down_proj's: d_ff
    assert widest == shape.d_ff
    assert "its product's fp32 buffer (no bf16 units)" not in with_units
    assert without["its product's fp32 buffer (no bf16 units)"] == N * widest * 4
    assert without["widest LoRA input gradient"] == N * widest * 2
    assert without["residual gradient"] == N * shape.d_model * 4
    assert "residual and MLP gradients" not in without
    assert sum(without.values()) > sum(with_units.values())
    fp32 = step_peak(shape, "lora", 4, "all-linear", B, T, weights=b.weights, grads=b.grads, optimizer=b.optimizer)
    assert "its product's fp32 buffer (no bf16 units)" not in fp32.phases["backward: last block"]  # fp32: no fallback


def test_gpt2_shape_is_planned_as_the_minigpt_it_imports_into(tmp_path):
    """count on a GPT-2 config.json: exact activations as minituner trains it (c_attn split into q/k/v)."""
    from minigpt.io import write_json
    from minituner.planner import load_config_shape
    write_json(tmp_path / "config.json", {"model_type": "gpt2", "vocab_size": 50, "n_positions": 16, "n_embd": 16,
                                          "n_layer": 2, "n_head": 2})
    gpt2 = load_config_shape(tmp_path / "config.json")
    mini = minigpt_shape(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, d_model=16))
    cfg = MemoryConfig(batch_size=B, seq_len=T, activations="exact", dtype="fp32", full_precision="fp32")
    for regime, t_gpt2, t_mini in (("full", "all-linear", "all-linear"), ("lora", "c_attn", "q_proj,k_proj,v_proj"),
                                   ("lora", "c_proj", "o_proj,fc2"), ("lora", "mlp.c_proj", "fc2")):
        r = Regime(regime, None if regime == "full" else 4)
        assert regime_bytes(gpt2, r, t_gpt2, cfg).activations == regime_bytes(mini, r, t_mini, cfg).activations
    assert regime_bytes(gpt2, Regime("full"), "all-linear", cfg).peak == regime_bytes(mini, Regime("full"),
                                                                                       "all-linear", cfg).peak


@pytest.mark.parametrize("regime, rank", [("full", None), ("lora", 4)])
def test_grad_accum_holds_every_gradient_in_each_backward(regime, rank):
    """After the first micro-batch every backward adds into the step's gradients: all of G in place of the grads a
    batch's backward has made so far; full FT's embeddings hold one more V x C gradient (the new one)."""
    shape = minigpt_shape(GPTConfig(**TINY))
    one, b = phases(shape, regime, rank)
    many = step_peak(shape, regime, rank, "all-linear", B, T, 4, False, weights=b.weights, grads=b.grads,
                     optimizer=b.optimizer, grad_accum=3)
    for name, terms in one.phases.items():
        total, added = sum(terms.values()), sum(many.phases[name].values())
        if name == "backward: embeddings":
            assert added == total + shape.vocab_size * shape.d_model * 4
        elif name.startswith("backward"):
            assert added == total - terms.get("grads so far (head, last block)", 0) + b.grads
        else:  # forwards and the optimizer step already run beside a full set of gradients
            assert added == total
    assert MemoryConfig(grad_accum=2).grad_accum == 2
    with pytest.raises(Exception, match="grad_accum must be a positive integer"):
        MemoryConfig(grad_accum=0)


@pytest.mark.parametrize("ckpt", [False, True])
def test_bf16_logits_kept_for_the_next_step_in_every_other_phase(ckpt):
    """bf16 compute on a CPU keeps the head's logits of at least large_output's 32 MiB from step to step
    (precision.keep_head_output): every phase but the loss's and the head's holds them, none under checkpointing,
    none for smaller logits, fp32 or CUDA."""
    from minikernels import large_output
    from minituner.planner.peak import kept_logits

    V = 32768
    shape = minigpt_shape(GPTConfig(**{**TINY, "vocab_size": V, "block_size": 512}))
    b = buckets(shape, Regime("lora", 4))
    widths = PRECISION_WIDTHS["bf16"]
    peak = step_peak(shape, "lora", 4, "all-linear", 1, 512, grad_checkpoint=ckpt, weights=b.weights, grads=b.grads,
                     optimizer=b.optimizer, **widths)
    kept = 512 * V * 2
    assert kept == large_output.MAPPED_BYTES
    term = "logits kept for the next step (keep_head_output)"
    for name, terms in peak.phases.items():
        counted_there = name in ("forward (loss)", "backward: loss", "backward: head")
        assert terms.get(term, 0) == (0 if ckpt or counted_there else kept), name
    assert kept_logits(511, V, 2, 4, True, False) == 0  # under 32 MiB: fresh pages each step, nothing kept
    assert kept_logits(512, V, 4, None, True, False) == 0  # fp32
    assert kept_logits(512, V, 2, 4, False, False) == 0  # CUDA

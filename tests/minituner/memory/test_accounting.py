"""account(model, optimizer): exact bytes of live tensors per bucket, against the tensors themselves and the planner."""
import pytest
import torch

from minigpt.model import GPTConfig, MiniGPT
from minigpt.train import lm_loss
from minituner.lora import LoRAConfig, apply_lora, lora_modules
from minituner.memory.accounting import (account, measure_training, process_rss_bytes, snapshot, storage_bytes,
                                         weight_breakdown)
from minituner.planner import MemoryConfig, Regime, lora_trainable_params, minigpt_shape, regime_bytes
from minituner.build import wrap_minigpt_qlora
from minituner.qlora import quantized_modules

CFG = GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=2, d_model=32)


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CFG)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def batch(n: int = 2):
    x = torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
    return [(x[:, :-1], x[:, 1:])] * n


def test_weights_are_the_unique_parameters_and_buffers():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight  # tied: one tensor, counted once
    expected = nbytes(model.parameters()) + nbytes(model.buffers())  # parameters() yields a tied weight once
    assert account(model) == {"weights": expected, "grads": 0, "optimizer": 0, "total": expected}
    assert expected == 4 * sum(p.numel() for p in model.parameters())


def test_full_training_step_buckets_sum_to_the_tensors_bytes():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (x, y), = batch(1)
    lm_loss(model, x, y).backward()
    opt.step()
    grads = [p.grad for p in model.parameters()]
    state = [v for s in opt.state.values() for v in s.values()]
    a = account(model, opt)
    assert a["grads"] == nbytes(grads) == a["weights"]
    assert a["optimizer"] == nbytes(state) == 2 * a["weights"] + 4 * len(opt.state)  # exp_avg, exp_avg_sq, 0-d step
    assert a["total"] == a["weights"] + a["grads"] + a["optimizer"]


def test_shared_storage_counts_once_and_empty_tensors_count_nothing():
    t = torch.zeros(10)
    seen: set = set()
    assert storage_bytes([t, t[:5], t.view(2, 5)], seen) == 40
    assert storage_bytes([t], seen) == 0  # already counted in an earlier bucket
    assert storage_bytes([torch.empty(0), None]) == 0


def test_qlora_weights_split_into_lora_quantized_and_frozen():
    model = wrap_minigpt_qlora(tiny(), r=4, device="cpu")
    lora = [p for p in model.parameters() if p.requires_grad]
    quant = [t for q in quantized_modules(model).values() for t in q.quantized_tensors()]
    others = [p for p in model.parameters() if not p.requires_grad] + [
        b for n, b in model.named_buffers() if not any(b is t for t in quant)]
    w = weight_breakdown(model)
    assert w["trainable"] == nbytes(lora) and w["quantized"] == nbytes(quant) == sum(
        q.storage_bytes() for q in quantized_modules(model).values())
    assert w["frozen"] == nbytes(others)
    assert w["total"] == account(model)["weights"]


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_qlora_accounting_equals_the_planner_up_to_fp32_lora(targets):
    """fp16 compute: the base matches the planner byte for byte; our LoRA factors (and their grads) are fp32, not fp16."""
    model = wrap_minigpt_qlora(tiny(), r=4, targets=targets, device="cpu", compute_dtype=torch.float16)
    shape, p = minigpt_shape(CFG), lora_trainable_params(minigpt_shape(CFG), 4, targets)
    planned = regime_bytes(shape, Regime("qlora", 4), targets, MemoryConfig())
    r = measure_training(model, batch(2), lm_loss)
    assert r["steps"] == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
    built, after = r["after_build"], r["after_steps"]
    assert built["weights"] == after["weights"] == planned.weights + 2 * p
    assert (built["grads"], built["optimizer"]) == (0, 0)
    assert after["grads"] == planned.grads + 2 * p
    assert after["optimizer"] == planned.optimizer + 4 * 2 * len(lora_modules(model))  # + a 4-byte step per tensor


def test_lora_fp16_base_accounting_equals_the_planner_up_to_fp32_lora():
    model = tiny().half()
    apply_lora(model, LoRAConfig(r=4))
    shape, p = minigpt_shape(CFG), lora_trainable_params(minigpt_shape(CFG), 4)
    planned = regime_bytes(shape, Regime("lora", 4))
    assert account(model)["weights"] == planned.weights + 2 * p


def test_snapshot_and_rss():
    model = tiny()
    s = snapshot(model)
    assert s["rss"] == pytest.approx(process_rss_bytes(), rel=0.5) and s["rss"] > s["total"]
    assert {k: s[k] for k in ("weights", "grads", "optimizer", "total")} == account(model)
    assert s["cuda_allocated"] is None or s["cuda_allocated"] >= 0


def test_measure_training_refuses_a_frozen_model():
    model = tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        measure_training(model, batch(1), lm_loss)

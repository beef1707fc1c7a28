"""minigpt.train.adamw: PyTorch's fused AdamW on CPU, in place (what minituner.planner counts for its step)."""
import pytest
import torch
import torch.nn as nn
from torch.profiler import profile

from minigpt.train import adamw


def params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((8, 512), (512, 8), (1 << 18,))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def test_cpu_adamw_is_fused_with_the_loops_betas():
    opt = adamw(params_with_grads(), lr=1e-3, weight_decay=0.1)
    assert opt.defaults["fused"] is True
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1


def test_its_step_allocates_no_tensor_of_a_parameters_size():
    ps = params_with_grads()
    opt = adamw(ps, lr=1e-3)
    opt.step()  # the first step makes the moments
    with profile(profile_memory=True) as prof:
        opt.step()
    largest = ps[-1].numel() * 4
    allocated = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= largest // 2]
    assert allocated == []  # the single-tensor loop allocates sqrt's and div's results here, 2 x 1 MiB
    loop = torch.optim.AdamW(params_with_grads(), lr=1e-3, betas=(0.9, 0.95), foreach=False)
    loop.step()
    with profile(profile_memory=True) as prof:
        loop.step()
    assert sum(1 for e in prof.events() if e.cpu_memory_usage >= largest // 2) == 2  # the check sees them


def test_its_updates_agree_with_the_single_tensor_loop():
    fused, loop = params_with_grads(), params_with_grads()
    a = adamw(fused, lr=1e-2, weight_decay=0.1)
    b = torch.optim.AdamW(loop, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step in range(5):
        a.step()
        b.step()
        g = torch.Generator().manual_seed(100 + step)
        for p, q in zip(fused, loop):
            q.grad = p.grad = torch.randn(p.shape, generator=g)
    for p, q in zip(fused, loop):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_what_the_fused_kernel_cannot_take_runs_torchs_default():
    assert adamw([nn.Parameter(torch.zeros(2, device="meta"))], lr=1e-3).defaults["fused"] is None
    assert adamw((p for p in params_with_grads()), lr=1e-3).defaults["fused"] is True  # a generator is read once
    with pytest.raises(ValueError):
        adamw([], lr=1e-3)


def test_a_checkpoint_of_the_single_tensor_loop_resumes_fused():
    from minigpt.train_state import keep_kernel_choice

    old, new = params_with_grads(), params_with_grads()
    loop = torch.optim.AdamW(old, lr=1e-2, betas=(0.9, 0.95), foreach=False)  # as checkpoints were written before
    loop.step()
    opt = adamw(new, lr=1e-2)
    built = [{k: g[k] for k in ("fused", "foreach")} for g in opt.param_groups]
    opt.load_state_dict(loop.state_dict())
    assert opt.param_groups[0]["fused"] is None  # what torch's load_state_dict does by itself
    keep_kernel_choice(opt, built)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    assert all(opt.state[p]["step"].dtype == torch.float32 for p in new)
    for p, q in zip(new, old):
        p.data.copy_(q.data)
    opt.step()
    loop.step()
    for p, q in zip(new, old):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)

"""Forward time of one LoRA layer (r = 8) against its base Linear: unmerged, merged, and PEFT's for reference.

Inference forwards (torch.no_grad), float32, interleaved rounds. B is random (not PEFT's zero init) so
that nothing can shortcut the adapter path; the time does not depend on the values. Also: forward +
backward of the GPT stack's fc1 (a training step's share), and the LoRA-B gradient in two layouts.

Each layer is built as a fine-tune holds it: the base frozen, an fp32 Linear an ``Fp32Linear``
(``minituner.precision.use_fp32_products``: its products through the library ``minikernels.fp32_gemm`` chose
for this CPU, oneDNN on an AMD CPU with AVX-512, PyTorch's own elsewhere). The goals compare ours with that
base, the same products with and without the adapter; PyTorch's plain nn.Linear and PEFT's layer over it
(PyTorch's library, MKL) are rows for reference.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minikernels import fp32_gemm
from minituner import native_lora_fp32
from minituner.lora import LoRALinear
from minituner.precision import use_fp32_products
from report import Goal, Section
from timing import fmt_ratio, time_interleaved

RANK = 8
ALPHA = 16.0
# (in, out, input shape): the GPT stack's fc1 at its training batch, and a LLaMA-7B-sized projection
CASES = [(512, 2048, (8, 128, 512)), (4096, 4096, (2, 128, 4096))]
UNMERGED_GOAL = 1.10  # unmerged time / base time
MERGED_GOAL = 1.02


BASE = "base, as a fine-tune runs it"  # the goals' reference: the frozen base's own products, no adapter
PLAIN = "PyTorch's nn.Linear"


def _layers(d_in: int, d_out: int) -> dict[str, nn.Module]:
    g = torch.Generator().manual_seed(0)
    plain = nn.Linear(d_in, d_out).requires_grad_(False)  # frozen, as a fine-tune's base
    with torch.no_grad():
        plain.weight.copy_(torch.randn(d_out, d_in, generator=g) * 0.02)
    base = use_fp32_products(nn.Sequential(copy.deepcopy(plain)))[0]  # what build_for_training makes of it in fp32
    unmerged = LoRALinear(copy.deepcopy(base), r=RANK, alpha=ALPHA)
    with torch.no_grad():
        unmerged.lora_B["default"].weight.copy_(torch.randn(d_out, RANK, generator=g) * 0.02)
    merged = copy.deepcopy(unmerged)
    merged.merge()
    layers = {BASE: base, PLAIN: plain, "ours, unmerged": unmerged, "ours, merged": merged}
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return layers
    holder = nn.Sequential()
    holder.add_module("proj", copy.deepcopy(plain))
    peft_model = get_peft_model(holder, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"], lora_dropout=0.0))
    with torch.no_grad():
        peft_model.base_model.model.proj.lora_B["default"].weight.copy_(unmerged.lora_B["default"].weight)
        peft_model.base_model.model.proj.lora_A["default"].weight.copy_(unmerged.lora_A["default"].weight)
    layers["PEFT, unmerged"] = peft_model
    return layers


def _training_rows(d_in: int, d_out: int, shape: tuple[int, ...], repeats: int) -> list[list[str]]:
    """Forward + backward of one layer with trainable LoRA factors and x requiring grad (a training step's share)."""
    layers = _layers(d_in, d_out)
    del layers["ours, merged"]
    for layer in layers.values():
        for pname, p in layer.named_parameters():
            p.requires_grad_("lora_" in pname)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(*shape[:-1], d_out, generator=torch.Generator().manual_seed(2))

    def fwd_bwd(layer):
        def call():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x).backward(g)
        return call

    t = time_interleaved({name: fwd_bwd(layer) for name, layer in layers.items()}, repeats=repeats, warmup=3, settle=1)
    base = t[BASE].median_s
    label = f"{d_in} → {d_out}"
    return [[label, "×".join(map(str, shape)), f"{name}, forward + backward", timing.fmt(),
             fmt_ratio(timing.median_s / base)] for name, timing in t.items()]


def _thin_product_rows(n: int, d_out: int, repeats: int) -> list[list[str]]:
    """The LoRA-B gradient, an (out, r) product of g (N, out) and a (N, r), in the two layouts BLAS can be asked for."""
    gen = torch.Generator().manual_seed(3)
    g, a = torch.randn(n, d_out, generator=gen), torch.randn(n, RANK, generator=gen)
    t = time_interleaved({
        "gᵀ·a (what nn.Linear's backward computes)": lambda: g.t() @ a,
        "(aᵀ·g)ᵀ (what LoRAUpdate computes)": lambda: (a.t() @ g).t(),
    }, repeats=repeats, warmup=3)
    ref = t["(aᵀ·g)ᵀ (what LoRAUpdate computes)"].median_s
    return [[f"grad of B ({d_out} × {RANK})", f"{n}×{d_out}", name, timing.fmt(), fmt_ratio(timing.median_s / ref)]
            for name, timing in t.items()]


def _library() -> str:
    """The library an Fp32Linear multiplies through on this machine, in words."""
    return "oneDNN" if fp32_gemm.backend() == "onednn" else "PyTorch's own library (F.linear)"


def _adapter_path() -> str:
    """Where ours runs the adapter's thin products in fp32 on this machine, in words."""
    if native_lora_fp32.kernels() is not None:
        return "one call of C, minituner.native_lora_fp32"
    return "PyTorch's ops: this CPU or build has no fp32 LoRA kernels"


def run(quick: bool = False) -> Section:
    section = Section(
        f"LoRA layer forward, r = {RANK}",
        "One layer, inference (no grad), float32, the base frozen. 'vs base' is the row's median over that of the "
        f"'{BASE}' row (an Fp32Linear: its products through {_library()}, as ours computes the base's), "
        f"timed in the same interleaved rounds. '{PLAIN}' and PEFT's layer over it multiply through PyTorch's own "
        "library. Every LoRA output is checked against W·x + b + (α/r)·B·A·x.",
        ["layer (in → out)", "input", "variant", "median", "vs base"],
    )
    repeats = 9 if quick else 31
    for d_in, d_out, shape in CASES:
        layers = _layers(d_in, d_out)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours = layers["ours, unmerged"]
            expected = layers[PLAIN](x) + (ALPHA / RANK) * (
                x @ ours.lora_A["default"].weight.t() @ ours.lora_B["default"].weight.t())
            for name, layer in layers.items():
                if name not in (BASE, PLAIN) and not torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-4):
                    raise AssertionError(f"{name} output differs from the LoRA formula")
            calls = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
            t = time_interleaved(calls, repeats=repeats, warmup=3, settle=1)
        base = t[BASE].median_s
        label = f"{d_in} → {d_out}"
        for name, timing in t.items():
            section.rows.append([label, "×".join(map(str, shape)), name, timing.fmt(), fmt_ratio(timing.median_s / base)])
        tokens = x.numel() // d_in
        flops_ratio = (d_in * RANK + RANK * d_out) / (d_in * d_out)
        section.goals.append(Goal(
            f"LoRA forward {label}, {tokens} tokens: unmerged / base", t["ours, unmerged"].median_s / base,
            UNMERGED_GOAL, False,
            f"the adapter adds {100 * flops_ratio:.1f}% of the base FLOPs in two thin products (r = {RANK}, "
            f"{_adapter_path()}) and one read-add-write of the {tokens}×{d_out} output after the base's GEMM",
        ))
        section.goals.append(Goal(
            f"LoRA forward {label}, {tokens} tokens: merged / base", t["ours, merged"].median_s / base,
            MERGED_GOAL, False,
            "the same GEMM as the base; the difference is the wrapper's Python call and timing noise",
        ))
    d_in, d_out, shape = CASES[0]
    section.rows += _training_rows(d_in, d_out, shape, max(5, repeats // 2))
    section.rows += _thin_product_rows(shape[0] * shape[1], d_out, repeats)
    section.notes += [
        "forward + backward rows: LoRA factors trainable, base frozen, x requires grad (as inside a training "
        f"step); 'vs base' is over the '{BASE}' row's forward + backward (its input gradient only)",
        "grad of B rows: the same product in two layouts; 'vs base' there is over LoRAUpdate's layout. PEFT and a "
        "plain nn.Linear lora_B get the first one from autograd",
    ]
    return section

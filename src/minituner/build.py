"""One way to build a model for training: full fine-tuning, LoRA or QLoRA, on a device, in a compute dtype.

    model, tok = load_base("artifacts/base")
    build_for_training(model, "qlora", LoRAConfig(r=8, alpha=16.0))   # NF4 targets + LoRA, only A/B train
    wrap_minigpt_qlora(model, r=8, alpha=16.0)                         # the same, in QLoRA's words

Every command and lab builds through ``build_for_training``. The steps, in order (each a function here):
check every input before changing anything -> move to the device -> quantize the targets (QLoRA; a
target that is already a ``QuantizedLinear`` of the scheme, e.g. quantized by a loader while reading, is
kept as it is) -> cast the frozen float tensors to the compute dtype -> wrap the targets with LoRA (fresh
factors, or an adapter loaded from a file) -> finite-output guards (QLoRA) -> check the trainable set ->
on CPU, glibc's malloc set to keep what a step frees and the heap trims of ``minituner.memory.heap`` (last, on the
modules the model ends up with).

Precision: ``precision="bf16"`` (``--precision bf16``, CPU with bf16 units or CUDA) builds in float32, then
``minituner.precision.use_bf16_compute`` stores the frozen base in bf16 and keeps the LoRA masters, norms and
loss in fp32; a device where bf16 would run slower than fp32 is refused first, unless ``allow_slow_bf16``.
Full fine-tuning trains every weight, so it only builds in float32 (bf16 is refused in one line).
A 16-bit checkpoint is never upcast whole: under bf16 only its norms (and other small float tensors) become
float32, its Linear and Embedding weights are kept as read and stored as the bf16 base.
``compute_dtype`` is the lower-level knob under ``precision="fp32"``: the dtype every frozen float tensor is
cast to (QLoRA defaults to bfloat16 on CUDA and float32 on CPU; LoRA to float32 on CPU and, on CUDA, to the
dtype the base was loaded in, ``float_dtype``). Computing in float32, a 16-bit checkpoint is not upcast whole
either (``minituner.upcast``): its frozen Linears, embeddings and output head stay as read, each Linear cast to
fp32 per product into a shared workspace (as NF4 dequantizes; the head a chunk of rows at a time), while norms
and other small float tensors become float32. A CPU without bf16 units would run bf16 products many times
slower than fp32 ones.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from minigpt.device import DEVICES, check_precision, resolve_device
from minigpt.errors import InputError
from miniquant import DEFAULT_QUANT_SCHEME, QuantizedLinear

from .adapter_io import load_adapter
from .lora import ALL_LINEAR, LoRAConfig, apply_lora, find_targets, lora_modules
from .memory.heap import keep_freed_memory, trim_heap_in_forward
from .precision import dtype_of_most_values, keep_head_output, use_bf16_compute, use_fp32_products
from .qlora import (COMPUTE_DTYPES, add_finite_guards, cast_float_tensors, check_qlora, check_scheme,
                    default_compute_dtype, quantize_linears)
from .upcast import compute_in_fp32

METHODS = ("full", "lora", "qlora")
FULL_IN_BF16 = ("--precision bf16 holds a frozen base in bf16, but full fine-tuning trains every weight: "
                "it trains in fp32 (--precision fp32), or use LoRA/QLoRA for bf16")


def training_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" or None: CUDA when present, else CPU; any other name or torch.device as given."""
    if device is None or (isinstance(device, str) and device in DEVICES):
        return resolve_device(device or "auto")
    return torch.device(device)


def float_dtype(model: nn.Module) -> torch.dtype:
    """The float dtype holding most of the model's float parameters (float32 when it has none)."""
    return dtype_of_most_values((p.dtype, p.numel()) for p in model.parameters())


def quantize_step(model: nn.Module, paths: list[str], scheme: str) -> list[str]:
    """Quantize the float nn.Linear among `paths` to `scheme`; keep those already quantized to it; return the new ones."""
    todo = []
    for p in paths:
        m = model.get_submodule(p)
        if isinstance(m, QuantizedLinear):
            if m.scheme != scheme:
                raise InputError(f"{p} is already quantized to {m.scheme}, not {scheme}")
        else:
            todo.append(p)
    quantize_linears(model, todo, scheme)  # from the float weights, before any cast
    return todo


def _check(model: nn.Module, method: str, lora: LoRAConfig, scheme: str, dtype: torch.dtype, precision: str,
           device: torch.device, allow_slow_bf16: bool) -> list[str]:
    """Every check that can fail on the user's input, before the model changes; returns the target paths."""
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if dtype not in COMPUTE_DTYPES:
        raise InputError(f"compute dtype must be one of {[str(d) for d in COMPUTE_DTYPES]}, got {dtype}")
    if precision == "bf16" and method == "full":
        raise InputError(FULL_IN_BF16)
    if precision == "bf16" and dtype != torch.float32:
        raise InputError(f"precision bf16 builds from float32 (norms stay fp32), not compute_dtype {dtype}")
    check_precision(precision, device, allow_slow_bf16)  # a device without bf16 units is refused here
    if method == "full":
        if dtype != torch.float32:
            raise InputError("full fine-tuning trains every weight in float32")
        return []
    lora.validate()
    if method == "qlora":
        check_scheme(scheme)
        if lora_modules(model):
            raise InputError("QLoRA needs a float base: this model already has LoRA layers")
    paths = find_targets(model, lora.target_modules)
    for p in paths:
        m = model.get_submodule(p)
        if lora.r > min(m.in_features, m.out_features):
            raise InputError(f"LoRA rank r={lora.r} exceeds min(in, out) = {min(m.in_features, m.out_features)} of {p}")
    return paths


def build_for_training(base: nn.Module, method: str = "lora", lora: LoRAConfig | None = None,
                       quant_scheme: str = DEFAULT_QUANT_SCHEME, device: str | torch.device | None = "auto",
                       compute_dtype: torch.dtype | None = None, *, precision: str = "fp32",
                       allow_slow_bf16: bool = False, adapter_name: str = "default",
                       init_adapter: str | Path | None = None, guards: bool = True,
                       heap_trims: bool = True) -> nn.Module:
    """Make `base` (a loaded float model) ready to train by `method`, in place, and return it.

    full: every parameter trains. lora: LoRA (`lora`, default LoRAConfig()) wraps the targets, only its
    factors train. qlora: the targets are quantized to `quant_scheme` first. `init_adapter` starts LoRA
    from a saved adapter (file, run folder or PEFT folder) instead of fresh factors. `guards` adds the
    finite-output hooks (QLoRA only); `heap_trims` the CPU heap trims of ``minituner.memory.heap``.
    `precision` "bf16": built in float32 (QLoRA quantizes from it), then the frozen base is stored in bf16
    (minituner.precision); refused where bf16 is slow unless allow_slow_bf16; on CPU its head writes large logits
    into the last step's memory once spent (``precision.keep_head_output``).
    """
    lora = lora or LoRAConfig()
    dev = training_device(device)
    if precision == "bf16":
        dtype = compute_dtype or torch.float32
    else:
        lora_dtype = torch.float32 if dev.type == "cpu" else float_dtype(base)
        dtype = compute_dtype or {"qlora": default_compute_dtype(dev), "lora": lora_dtype}.get(method, torch.float32)
    paths = _check(base, method, lora, quant_scheme, dtype, precision, dev, allow_slow_bf16)
    base.to(dev)
    if method == "full":
        base.requires_grad_(True)
        use_fp32_products(base)  # fp32 Linears, their gradients too, through minikernels.fp32_gemm (oneDNN on AMD)
    else:
        _adapt(base, method, lora, paths, quant_scheme, dtype, precision, adapter_name, init_adapter, guards)
    if dev.type == "cpu":
        keep_freed_memory()  # glibc: what a step frees stays for the next, not faulted in again page by page
    if dev.type == "cpu" and precision == "bf16":
        keep_head_output(base)  # a large vocabulary's bf16 logits: the last step's memory again, once spent
    if dev.type == "cpu" and heap_trims:  # last: bf16, quantization or LoRA may have replaced the head
        trim_heap_in_forward(base)  # glibc keeps a forward's freed temporaries resident; give them back
    return base


def _adapt(base: nn.Module, method: str, lora: LoRAConfig, paths: list[str], quant_scheme: str, dtype: torch.dtype,
           precision: str, adapter_name: str, init_adapter: str | Path | None, guards: bool) -> None:
    """LoRA or QLoRA on a checked base already on its device: quantize, cast, wrap, bf16, guards, check."""
    if method == "qlora":
        quantize_step(base, paths, check_scheme(quant_scheme))
    # frozen float tensors only (a no-op on a float32 base in float32); under bf16 the weights use_bf16_compute
    # stores in bf16 are left as read, and in float32 a 16-bit checkpoint's Linears, embeddings and head stay 16-bit
    # (minituner.upcast), so a 16-bit checkpoint is not upcast whole on the way
    if precision == "bf16":
        cast_float_tensors(base, dtype, keep=(nn.Linear, nn.Embedding))
    elif dtype == torch.float32:
        compute_in_fp32(base)
    else:
        cast_float_tensors(base, dtype)
    targeted = LoRAConfig(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=paths,
                          use_rslora=lora.use_rslora)
    if init_adapter is not None:
        load_adapter(base, init_adapter, config=targeted, adapter_name=adapter_name)
    else:
        apply_lora(base, targeted, adapter_name)  # fresh factors: float32, on the base layer's device
    if precision == "bf16":
        use_bf16_compute(base)  # the frozen base in bf16, the LoRA masters fp32 (checked by _check above)
    else:
        use_fp32_products(base)  # the frozen fp32 Linears through minikernels.fp32_gemm (oneDNN on AMD)
    if method == "qlora" and guards:
        add_finite_guards(base)
    check_qlora(base)  # the trainable set is exactly the active LoRA factors


def wrap_minigpt_qlora(model: nn.Module, r: int = 8, alpha: float = 16.0, quant_scheme: str = DEFAULT_QUANT_SCHEME,
                       targets: str | list[str] = ALL_LINEAR, dropout: float = 0.0, use_rslora: bool = False,
                       adapter_name: str = "default", device: str | torch.device | None = None,
                       compute_dtype: torch.dtype | None = None, guards: bool = True) -> nn.Module:
    """QLoRA in its own words: ``build_for_training(model, "qlora", LoRAConfig(r, alpha, ...), quant_scheme, ...)``.

    Returns the model, on `device` (default CUDA when present, else CPU), with the float parts in
    `compute_dtype` (default bfloat16 on CUDA, float32 on CPU) and only the LoRA factors trainable.
    """
    cfg = LoRAConfig(r=r, alpha=alpha, dropout=dropout, target_modules=targets, use_rslora=use_rslora)
    return build_for_training(model, "qlora", cfg, quant_scheme, device, compute_dtype, adapter_name=adapter_name,
                              guards=guards)

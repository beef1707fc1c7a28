"""QLoRA's pieces: quantize the LoRA targets (NF4 by default), cast the frozen float tensors, guard
and check the result, and count parameters with a quantized weight counted by its elements.

``minituner.build.build_for_training(model, "qlora", LoRAConfig(...))`` chains them (and
``build.wrap_minigpt_qlora`` is its shorthand); the order is the QLoRA recipe's: each targeted
``nn.Linear`` becomes a miniquant ``QuantizedLinear`` (quantized buffers, no parameters), and a
``LoRALinear`` wraps that. The LoRA factors are never quantized: they stay float32 nn.Linear weights,
the only trainable parameters (checked, not assumed).

Compute dtype: a dtype other than float32 casts the frozen float tensors (embeddings, norms, biases) to
it; the quantized buffers are never cast (their float32 absmax is part of the format), and they
dequantize to the input's dtype on the fly. The LoRA factors stay float32 (LoRALinear casts the input
to them and back).

Finite-value guards: QuantizedLinear refuses a dequantized weight with NaN/Inf (the dequant path);
a forward hook on every LoRALinear refuses a non-finite output and says whether the input, the base
(dequantized) path or the LoRA path produced it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.errors import InputError
from miniquant import DEFAULT_QUANT_SCHEME, QuantizationError, QuantizedLinear, parse_scheme

from .lora import LoRALinear, lora_modules

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (QLoRA's compute dtype), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_scheme(scheme: str) -> str:
    """The scheme's name if miniquant knows it; otherwise an InputError listing the valid ones."""
    try:
        return parse_scheme(scheme).name
    except QuantizationError as e:
        raise InputError(str(e)) from None


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def quantize_linears(model: nn.Module, paths: list[str], scheme: str = DEFAULT_QUANT_SCHEME) -> dict[str, QuantizedLinear]:
    """Replace the nn.Linear at each path by a QuantizedLinear of `scheme`, in place; return them by path."""
    for p in paths:  # check everything before changing anything
        if not isinstance(model.get_submodule(p), nn.Linear):  # nn.Linear or a subclass (precision.Fp32Linear)
            raise InputError(f"{p} is a {type(model.get_submodule(p)).__name__}, not a float nn.Linear to quantize")
        if not torch.isfinite(model.get_submodule(p).weight).all():
            raise InputError(f"{p}.weight holds NaN or Inf values: the base checkpoint is damaged, and a quantizer "
                             "cannot scale such a weight")
    out = {}
    for p in paths:
        parent, _, leaf = p.rpartition(".")
        out[p] = QuantizedLinear.from_linear(model.get_submodule(p), scheme)
        setattr(model.get_submodule(parent), leaf, out[p])
    return out


@torch.no_grad()
def cast_float_tensors(model: nn.Module, dtype: torch.dtype, keep: tuple[type, ...] = ()) -> None:
    """Cast the float parameters and buffers to `dtype`, except the LoRA factors, quantized weights and
    modules of the `keep` types (exactly those types, e.g. nn.Linear: left in the dtype they were read in).

    A QuantizedLinear keeps its quantized buffers (codes and float32 scales) and casts its bias only.
    """
    lora_factors = {id(f) for m in lora_modules(model).values() for d in (m.lora_A, m.lora_B) for f in d.values()}
    for module in model.modules():
        if id(module) in lora_factors or type(module) in keep:
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)  # a tied parameter is one object: cast once, stays tied
        quantized = {id(t) for t in module.quantized_tensors()} if isinstance(module, QuantizedLinear) else set()
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and id(b) not in quantized and b.dtype != dtype:
                setattr(module, name, b.to(dtype))


def _guard(path: str, module: LoRALinear, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
    """Forward hook (with kwargs): a non-finite output is an error naming the module and the path that produced it.
    The layer's input is args[0], or GELU's output of it where it was handed GELU's input (kwargs' gelu)."""
    if module.output_seen_finite(output):  # the bf16 C kernels looked at every value as they wrote it
        return
    # one reduction: any NaN/inf makes the sum non-finite. bf16 keeps fp32's exponent range and PyTorch sums it with
    # an fp32 accumulator, so it sums in its own dtype (asking for an fp32 sum first makes a whole fp32 copy of the
    # output: at Llama-3.2-1B's shape about 2% of a bf16 step); fp16 (largest value 65,504) sums in fp32
    if torch.isfinite(torch.sum(output, dtype=torch.float32 if output.dtype == torch.float16 else None)):
        return
    if torch.isfinite(output).all():  # a float32 overflow of the sum alone: the values themselves are finite
        return
    x = args[0]
    if kwargs.get("gelu") is not None:  # (GELU's input: the layer read its output)
        x = F.gelu(x, approximate=kwargs["gelu"])
    if not torch.isfinite(x).all():
        where = "its input"
    else:
        with torch.no_grad():
            where = "the LoRA path" if torch.isfinite(module.base_layer(x)).all() else "the base (dequantized) path"
    raise FloatingPointError(f"{path}: non-finite output (NaN or inf) from {where}")


def add_finite_guards(model: nn.Module) -> int:
    """Register the finite-output guard on every LoRALinear that lacks one; return how many were added."""
    added = 0
    for path, m in lora_modules(model).items():
        if not getattr(m, "_finite_guard", False):
            m.register_forward_hook(partial(_guard, path), with_kwargs=True)
            m._finite_guard = True
            added += 1
    return added


def check_qlora(model: nn.Module) -> None:
    """The trainable set is exactly the active LoRA factors, none quantized, and quantized layers hold no parameter."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {f"{path}.lora_{ab}.{name}.weight" for path, m in lora_modules(model).items()
            for name in m.active_adapters if name in m.lora_A for ab in "AB"}
    if trainable != lora:
        extra, missing = sorted(trainable - lora), sorted(lora - trainable)
        raise RuntimeError(f"QLoRA trainable set is not the LoRA parameters: extra {extra[:4]}, missing {missing[:4]}")
    for path, m in lora_modules(model).items():
        for ab in (m.lora_A, m.lora_B):
            for name, layer in ab.items():
                if type(layer) is not nn.Linear or not layer.weight.is_floating_point():
                    raise RuntimeError(f"{path}: LoRA factor {name} is not a float nn.Linear ({type(layer).__name__})")
    for path, q in quantized_modules(model).items():
        if any(True for _ in q.parameters()):
            raise RuntimeError(f"{path}: a quantized layer holds parameters")


@dataclass(frozen=True)
class ParamSummary:
    trainable: int  # parameters that require grad (the LoRA factors)
    base: int  # base parameters, a quantized weight counted by its logical number of elements (+ its bias)
    quantized: int  # of which stored quantized (weights of QuantizedLinear layers), in elements
    quantized_bytes: int  # bytes those quantized weights take (codes + scales)

    @property
    def all(self) -> int:
        """PEFT's "all params": base + adapter."""
        return self.base + self.trainable

    def to_dict(self) -> dict:
        return {"trainable": self.trainable, "base": self.base, "quantized": self.quantized,
                "quantized_bytes": self.quantized_bytes, "all": self.all}


def logical_numel(model: nn.Module) -> int:
    """Parameters of the model, a quantized layer counted by its logical elements (in x out weight + bias)."""
    quantized = quantized_modules(model).values()
    return sum(p.numel() for p in model.parameters()) + sum(
        q.in_features * q.out_features + (0 if q.bias is None else q.bias.numel()) for q in quantized)


def param_summary(model: nn.Module) -> ParamSummary:
    """Counts with quantized weights at their logical size (PEFT and the QLoRA scripts once halved them)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_float = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad and "lora_" not in n)
    quantized = q_bias = q_bytes = 0
    for q in quantized_modules(model).values():
        quantized += q.in_features * q.out_features
        q_bias += 0 if q.bias is None else q.bias.numel()
        q_bytes += q.storage_bytes()
    return ParamSummary(trainable, frozen_float + quantized + q_bias, quantized, q_bytes)


def print_trainable_parameters(model: nn.Module, log=print) -> str:
    """PEFT's line (trainable / all incl. adapter), then the base count with the quantized share."""
    s = param_summary(model)
    schemes = sorted({q.scheme for q in quantized_modules(model).values()})
    text = (f"trainable params: {s.trainable:,} || all params: {s.all:,} || "
            f"trainable%: {100 * s.trainable / s.all:.4f}\n"
            f"base params: {s.base:,} (of which {s.quantized:,} in {', '.join(schemes) or 'no quantized layer'}, "
            f"stored in {s.quantized_bytes:,} bytes; counted by element, not by byte) || "
            f"trainable / base: {100 * s.trainable / s.base:.2f}%")
    log(text)
    return text


@torch.no_grad()
def compare_logits(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """How far `other` logits (..., V) are from `ref`: mean/max |diff|, its ratio to mean |ref|, top-1 agreement."""
    ref, other = ref.float(), other.float()
    diff = (ref - other).abs()
    mean_ref = float(ref.abs().mean())
    return {"mean_abs_diff": float(diff.mean()), "mean_abs_ref": mean_ref, "ratio": float(diff.mean()) / mean_ref,
            "max_abs_diff": float(diff.max()),
            "top1_agreement": float((ref.argmax(-1) == other.argmax(-1)).float().mean())}


@torch.no_grad()
def weight_errors(float_model: nn.Module, model: nn.Module) -> dict[str, float]:
    """||dequantize(Q(W)) - W|| / ||W|| (Frobenius) of each quantized layer, keyed by its Linear's path."""
    out = {}
    for path, q in quantized_modules(model).items():
        path = path.removesuffix(".base_layer")
        w = float_model.get_submodule(path).weight.float()
        out[path] = float((q.dequantize(torch.float32) - w).norm() / w.norm())
    return out

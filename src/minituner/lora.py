"""LoRA: y = W·x + b + (alpha/r)·B·A·x, with W frozen, A (r × in) random and B (out × r) zero at step 0.

``LoRALinear`` wraps a base layer (an ``nn.Linear`` or a quantized linear with ``in_features``,
``out_features``, ``bias`` and ``dequantize()``) and holds one or more named adapters, laid out as PEFT
lays them out: ``<path>.base_layer.*``, ``<path>.lora_A.<adapter>.weight``, ``<path>.lora_B.<adapter>.weight``.
Adapter files drop the adapter name, as PEFT's do: ``<path>.lora_A.weight`` and ``<path>.lora_B.weight``,
the same keys whether the base is float or quantized. Merging is explicit (``merge``/``unmerge``),
idempotent, computed in fp32 and refused when the result is not finite.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from minigpt import native_gelu
from minigpt.errors import InputError, check_known_fields

from . import native_lora
from .lora_product import fused_fits, lora_product
from .planner.counts import ALL_LINEAR  # one spelling of PEFT's "all-linear", shared with the planner

OUTPUT_HEADS = ("lm_head",)  # never a LoRA target: tied to the token embedding in MiniGPT


@dataclass
class LoRAConfig:
    r: int = 8  # rank of the update B·A
    alpha: float = 16.0  # scaling = alpha / r (alpha / sqrt(r) with use_rslora); PEFT's lora_alpha
    dropout: float = 0.0  # dropout on the LoRA path's input only; the base path never sees it
    target_modules: str | list[str] = ALL_LINEAR  # leaf names (q_proj), path suffixes or "all-linear"
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)

    def validate(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise InputError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise InputError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise InputError("LoRA target_modules is empty")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        check_known_fields(cls, d)
        return cls(**d)


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor on B·A: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return alpha / (math.sqrt(r) if use_rslora else r)


def is_linear_like(module: nn.Module) -> bool:
    """An nn.Linear, or a quantized linear honouring the contract (in/out_features, bias, dequantize())."""
    if isinstance(module, nn.Linear):
        return True
    return all(hasattr(module, a) for a in ("in_features", "out_features", "bias")) and callable(
        getattr(module, "dequantize", None)
    ) and not isinstance(module, LoRALinear)


def _device(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _check_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(t).all():
        raise FloatingPointError(f"{what}: the result has non-finite values (NaN or inf); nothing was changed")
    return t


class LoRAUpdate(torch.autograd.Function):
    """y += scale · (h·Aᵀ)·Bᵀ in place, for 2-D y (N, out) and h (N, in); the LoRA path of LoRALinear.

    One pass over y in forward (no (N, out) temporaries), and a backward that picks the BLAS-friendly
    layout for each thin product: grad_B as (aᵀ·g)ᵀ and grad_a as (Bᵀ·gᵀ)ᵀ, not gᵀ·a and g·B (what
    nn.Linear's backward computes, several times slower on CPU for these thin shapes; see
    benchmarks/RESULTS.md). Saves h (the base saved it too), A, B and a = h·Aᵀ (N, r).
    The base output y is not saved by its own backward, so updating it in place is safe (a base that
    saved it would make autograd raise, not compute wrong gradients).
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, h: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
        a = h @ A.t()  # (N, r)
        y.addmm_(a, B.t(), alpha=scale)  # (N, out)
        ctx.mark_dirty(y)
        ctx.save_for_backward(h, A, B, a)
        ctx.scale = scale
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):  # g (N, out)
        h, A, B, a = ctx.saved_tensors
        need_y, need_h, need_A, need_B, _ = ctx.needs_input_grad
        grad_h = grad_A = grad_B = None
        if need_h or need_A:
            grad_a_t = (B.t().contiguous() @ g.t()).mul_(ctx.scale)  # (r, N): Bᵀ·gᵀ, the fast layout
            grad_A = grad_a_t @ h if need_A else None  # (r, in)
            grad_h = grad_a_t.t() @ A if need_h else None  # (N, in)
        if need_B:
            grad_B = (a.t() @ g).mul_(ctx.scale).t()  # (r, out) -> (out, r)
        return g if need_y else None, grad_h, grad_A, grad_B, None


def _keeps_finite(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a finite src value stays finite cast to dst (bf16 -> fp16 can overflow: 65,504 is fp16's largest)."""
    return torch.finfo(dst).max >= torch.finfo(src).max


class LoRALinear(nn.Module):
    """A base linear layer plus named low-rank adapters: base_layer(x) + Σ w·scaling·B(A(dropout(x))).

    ``layer(h, gelu="none")`` (or "tanh", F.gelu's approximate) is ``layer(F.gelu(h, approximate=...))``: a model
    whose MLP feeds GELU's output to this layer hands over GELU's input instead (``takes_gelu_input``), and where
    the base is NF4 and miniquant.nf4_matmul runs its input gradient (bf16, ``_fuses_gelu``) GELU runs inside
    the one Function (``lora_product``), its gradient applied in that same product (one pass over (N, in) less).
    """

    takes_gelu_input = True  # forward(h, gelu=approximate): see the class docstring (minigpt.model.MLP asks)

    def __init__(self, base_layer: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 use_rslora: bool = False, adapter_name: str = "default") -> None:
        super().__init__()
        if not is_linear_like(base_layer):
            raise TypeError(f"LoRALinear needs an nn.Linear or a quantized linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.lora_A, self.lora_B, self.lora_dropout = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.lora_alpha: dict[str, float] = {}
        self.use_rslora: dict[str, bool] = {}
        self.scaling: dict[str, float] = {}
        self.active_adapters: dict[str, float] = {}  # adapter name -> weight in the output
        self.merged_adapters: dict[str, float] = {}  # what merge() added into the base weight
        self.disabled = False  # True: output is the base layer's alone
        self.compute_dtype: torch.dtype | None = None  # e.g. bf16: base and LoRA path computed in it (one input cast)
        self._seen_finite: tuple[weakref.ref, int] | None = None  # (the last output, its version): see output_seen_finite
        self.train(base_layer.training)  # a wrapper in an eval()-mode model stays in eval mode
        self.add_adapter(adapter_name, r, alpha, dropout, use_rslora)
        self.active_adapters = {adapter_name: 1.0}

    def add_adapter(self, name: str, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False) -> None:
        """A fresh adapter: A kaiming-uniform (a=√5, as PEFT), B zero, so it adds nothing until trained."""
        if name in self.lora_A:
            raise InputError(f"adapter {name!r} already exists")
        if not 0 < r <= min(self.in_features, self.out_features):
            raise InputError(f"LoRA rank r={r} must be in 1..min(in, out) = {min(self.in_features, self.out_features)}")
        device = _device(self.base_layer)
        self.lora_A[name] = nn.Linear(self.in_features, r, bias=False, device=device)  # weight (r, in)
        self.lora_B[name] = nn.Linear(r, self.out_features, bias=False, device=device)  # weight (out, r)
        nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[name].weight)
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_dropout[name].train(self.training)
        self.r[name], self.lora_alpha[name], self.use_rslora[name] = r, float(alpha), use_rslora
        self.scaling[name] = lora_scaling(alpha, r, use_rslora)

    def delete_adapter(self, name: str) -> None:
        if name in self.merged_adapters:
            raise RuntimeError(f"adapter {name!r} is merged; unmerge first")
        for d in (self.lora_A, self.lora_B, self.lora_dropout):
            del d[name]
        for d in (self.r, self.lora_alpha, self.use_rslora, self.scaling, self.active_adapters):
            d.pop(name, None)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_seen_finite": None}  # (a weak reference does not pickle)

    def output_seen_finite(self, output: torch.Tensor) -> bool:
        """Whether `output`, what forward just returned, is known to be all finite without reading it again: the bf16
        C kernels (minituner.native_lora) look at every value as they write it. True only for that very tensor,
        unchanged since (its version counter); asked once (the answer is forgotten)."""
        seen = self.__dict__.get("_seen_finite")
        self._note_seen_finite(None)
        return seen is not None and seen[0]() is output and output._version == seen[1]

    def _note_seen_finite(self, seen: tuple[weakref.ref, int] | None) -> None:
        # straight into the instance's dict: nn.Module.__setattr__ looks for a parameter, buffer or module of the
        # name first (about 1 µs, three times in each forward of a step)
        self.__dict__["_seen_finite"] = seen

    def _fuses_gelu(self, x: torch.Tensor) -> bool:
        """Whether forward(x, gelu=...) runs GELU inside lora_product: one active adapter whose fused Function takes
        x as it is (already in the compute dtype: GELU then applies to the values it would see), with the adapter's
        thin products in C (minituner.native_lora) and a base that applies GELU's gradient inside its input
        gradient's product (an NF4 base where miniquant.nf4_matmul runs: ``applies_gelu_grad``). Elsewhere GELU
        is applied apart: applied after the layer's own backward, its gradient would be one more (N, in) tensor
        alive beside the layer's saved input."""
        if self.disabled or self.merged_adapters or len(self.active_adapters) != 1:
            return False
        name = next(iter(self.active_adapters))
        cd, applies = self.compute_dtype, getattr(self.base_layer, "applies_gelu_grad", None)
        if name not in self.lora_A or cd is None or x.dtype != cd or applies is None or not applies(cd):
            return False
        x2 = x.reshape(-1, self.in_features)
        return (native_lora.fits(x2, self.lora_A[name].weight, self.lora_B[name].weight)
                and fused_fits(self, x2, name))

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        cd = self.compute_dtype
        self._note_seen_finite(None)
        fuse_gelu = gelu is not None and self._fuses_gelu(x)
        if gelu is not None and not fuse_gelu:  # GELU's input: applied here, as the model would (autograd's gradient)
            x = native_gelu.gelu(x, gelu)
        if self.disabled or self.merged_adapters:  # merged adapters already live in the base weight
            return self.base_layer(x) if cd is None else self.base_layer(x.to(cd)).to(x.dtype)  # (..., out)
        x2 = x.reshape(-1, self.in_features)  # (N, in): 2-D, so the base output is a plain (N, out) tensor
        if cd is not None:
            x2 = x2.to(cd)  # one cast, shared by the base and every adapter; the base computes in its input's dtype
        if len(self.active_adapters) == 1:  # base and adapter as one Function (lora_product: bf16, or fp32 with C)
            (name, weight), = self.active_adapters.items()
            if fuse_gelu or (name in self.lora_A and fused_fits(self, x2, name)):
                y, finite = lora_product(self, x2, name, self.scaling[name] * weight,  # (N, out): the lines below,
                                         gelu if fuse_gelu else None)  # fused (GELU too, x2 its input, where asked)
                out = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
                if finite and _keeps_finite(y.dtype, out.dtype) and not out.is_inference():  # (no version counter)
                    self._note_seen_finite((weakref.ref(out), out._version))
                return out
        y = self.base_layer(x2)  # (N, out)
        for name, weight in self.active_adapters.items():
            if name not in self.lora_A:
                continue
            A, B = self.lora_A[name].weight, self.lora_B[name].weight  # the masters (fp32)
            if cd is not None:  # computed in cd; autograd casts their gradients back to the masters' dtype
                A, B = A.to(cd), B.to(cd)
            h = self.lora_dropout[name](x2.to(A.dtype))  # (N, in)
            scale = self.scaling[name] * weight
            if y.dtype == B.dtype and y._base is None and y.is_contiguous():
                y = LoRAUpdate.apply(y, h, A, B, scale)  # in place: y += scale · h·Aᵀ·Bᵀ
            else:
                y = y + ((h @ A.t()) @ B.t() * scale).to(y.dtype)  # (N, r) -> (N, out)
        if cd is not None:
            y = y.to(x.dtype)  # the caller's dtype (bf16 after a norm that hands out bf16; fp32 if fed fp32)
        return y.view(*x.shape[:-1], self.out_features)  # (..., out)

    def delta_weight(self, adapters: dict[str, float] | None = None) -> torch.Tensor:
        """Σ w·scaling·B·A over the given (default: active) adapters, in fp32, shape (out, in)."""
        adapters = self.active_adapters if adapters is None else adapters
        delta = torch.zeros(self.out_features, self.in_features, device=_device(self.base_layer))
        for name, weight in adapters.items():
            if name in self.lora_A:
                B, A = self.lora_B[name].weight.float(), self.lora_A[name].weight.float()
                delta += (weight * self.scaling[name]) * (B @ A)
        return delta

    def base_weight(self) -> torch.Tensor:
        """The base weight (out, in) as a float tensor: nn.Linear's weight, or the dequantized one."""
        if isinstance(self.base_layer, nn.Linear):
            return self.base_layer.weight.detach()
        return self.base_layer.dequantize().detach()

    def merge(self) -> None:
        """Add the active adapters into the nn.Linear base weight (fp32 arithmetic); a no-op if merged."""
        if self.merged_adapters or self.disabled:
            return
        if self.compute_dtype is not None:
            raise InputError(f"cannot merge under {self.compute_dtype} compute: the base is stored in that dtype and "
                             "unmerge would not restore it exactly; save the adapter and merge into the fp32 base")
        if not isinstance(self.base_layer, nn.Linear):
            raise InputError("cannot merge into a quantized base in place; use merged_linear() (dequantize -> merge -> float layer)")
        if self.base_layer.weight.dtype in (torch.bfloat16, torch.float16):
            raise InputError(f"cannot merge into a {str(self.base_layer.weight.dtype).removeprefix('torch.')} base weight "
                             "in place: unmerge would not restore it exactly; use merged_linear() or merge_and_unload()")
        self._set_weight(self.delta_weight(), "merge")
        self.merged_adapters = dict(self.active_adapters)

    def unmerge(self) -> None:
        """Subtract what merge() added; a no-op if nothing is merged."""
        if not self.merged_adapters:
            return
        self._set_weight(-self.delta_weight(self.merged_adapters), "unmerge")
        self.merged_adapters = {}

    def _set_weight(self, delta: torch.Tensor, what: str) -> None:
        w = self.base_layer.weight
        new = _check_finite((w.detach().float() + delta).to(w.dtype), what)
        with torch.no_grad():
            w.copy_(new)

    def merged_linear(self) -> nn.Linear:
        """A new float nn.Linear holding W + ΔW; for a quantized base W is dequantize() (explicit, exact in fp32)."""
        w = self.base_weight()
        delta = torch.zeros_like(w, dtype=torch.float32) if self.merged_adapters or self.disabled else self.delta_weight()
        dtype = w.dtype if w.is_floating_point() else torch.float32
        merged = _check_finite((w.float() + delta).to(dtype), "merged_linear")
        bias = self.base_layer.bias
        layer = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=w.device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(merged)
            if bias is not None:
                layer.bias.copy_(bias.detach().to(dtype))
        return layer

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, adapters={self.r}, active={self.active_adapters}"


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _output_heads(model: nn.Module) -> set[str]:
    heads = {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in OUTPUT_HEADS}
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    heads |= {n for n, m in model.named_modules() if out is not None and m is out}
    return heads


def linear_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Every module a LoRA target may name: linear layers (float, quantized or wrapped), not the output head."""
    wrapped = lora_modules(model)
    inside = tuple(f"{p}." for p in wrapped)
    heads = _output_heads(model)
    return {n: m for n, m in model.named_modules()
            if n and n not in heads and not n.startswith(inside) and (n in wrapped or is_linear_like(m))}


def find_targets(model: nn.Module, target_modules: str | list[str]) -> list[str]:
    """Module paths selected by target names (path == name or path ends with '.name'), or all-linear."""
    candidates = linear_candidates(model)
    if isinstance(target_modules, str):
        target_modules = [t.strip() for t in target_modules.split(",") if t.strip()]
    valid = sorted({n.rsplit(".", 1)[-1] for n in candidates}) + [ALL_LINEAR]
    everything = any(t.lower() == ALL_LINEAR for t in target_modules)
    chosen: set[str] = set()
    for t in target_modules:  # beside all-linear too: a name it does not cover (lm_head) is not silently dropped
        if t.lower() == ALL_LINEAR:
            continue
        hits = [n for n in candidates if n == t or n.endswith("." + t)]
        if not hits:
            raise InputError(f"unknown LoRA target {t!r}; valid names: {valid} (or a path suffix such as blocks.0.attn.q_proj)")
        chosen.update(hits)
    return [n for n in candidates if everything or n in chosen]  # model order


def apply_lora(model: nn.Module, config: LoRAConfig, adapter_name: str = "default") -> list[str]:
    """Wrap the targets in place (or add `adapter_name` to existing wrappers), freeze everything else,
    make `adapter_name` the active, trainable adapter; return the wrapped module paths."""
    config.validate()
    if any(m.merged_adapters for m in lora_modules(model).values()):
        raise InputError("adapters are merged into the base weights; unmerge before adding another")
    paths = find_targets(model, config.target_modules)
    for p in paths:  # check every target before changing anything
        m = model.get_submodule(p)
        if config.r > min(m.in_features, m.out_features):
            raise InputError(f"LoRA rank r={config.r} exceeds min(in, out) = {min(m.in_features, m.out_features)} of {p}")
        if isinstance(m, LoRALinear) and adapter_name in m.lora_A:
            raise InputError(f"{p} already has an adapter named {adapter_name!r}")
    for p in paths:
        m = model.get_submodule(p)
        if isinstance(m, LoRALinear):
            m.add_adapter(adapter_name, config.r, config.alpha, config.dropout, config.use_rslora)
        else:
            parent, _, leaf = p.rpartition(".")
            setattr(model.get_submodule(parent), leaf,
                    LoRALinear(m, config.r, config.alpha, config.dropout, config.use_rslora, adapter_name))
    activate(model, {adapter_name: 1.0})
    return paths


def activate(model: nn.Module, weights: dict[str, float]) -> None:
    """Make exactly these adapters active (with output weights) and trainable; freeze every other parameter."""
    if any(m.merged_adapters for m in lora_modules(model).values()):
        raise InputError("adapters are merged into the base weights; unmerge before changing the active adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    for m in lora_modules(model).values():
        m.active_adapters = {n: float(w) for n, w in weights.items() if n in m.lora_A}
        for n in m.active_adapters:
            m.lora_A[n].weight.requires_grad_(True)
            m.lora_B[n].weight.requires_grad_(True)


def adapter_names(model: nn.Module) -> list[str]:
    names: list[str] = []
    for m in lora_modules(model).values():
        names += [n for n in m.lora_A if n not in names]
    return names


def resolve_adapter(model: nn.Module, adapter_name: str | None) -> str:
    """The named adapter, or (None) the only adapter / the only active one."""
    names = adapter_names(model)
    if not names:
        raise InputError("the model has no LoRA adapter")
    if adapter_name is not None:
        if adapter_name not in names:
            raise InputError(f"no adapter named {adapter_name!r}; adapters: {names}")
        return adapter_name
    if len(names) == 1:
        return names[0]
    active = {n for m in lora_modules(model).values() for n in m.active_adapters}
    if len(active) != 1:
        raise InputError(f"several adapters ({names}) and {len(active)} active: name the one you mean")
    return active.pop()


def lora_state_dict(model: nn.Module, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
    """One adapter's tensors, keyed '<module path>.lora_A.weight' / '.lora_B.weight' (detached, not copied)."""
    name = resolve_adapter(model, adapter_name)
    out: dict[str, torch.Tensor] = {}
    for path, m in lora_modules(model).items():
        if name in m.lora_A:
            out[f"{path}.lora_A.weight"] = m.lora_A[name].weight.detach()
            out[f"{path}.lora_B.weight"] = m.lora_B[name].weight.detach()
    return out


def adapter_config(model: nn.Module, adapter_name: str | None = None) -> LoRAConfig:
    """The LoRAConfig of an adapter as it lives in the model (targets = the wrapped paths)."""
    name = resolve_adapter(model, adapter_name)
    mods = {p: m for p, m in lora_modules(model).items() if name in m.lora_A}
    first = next(iter(mods.values()))
    drop = first.lora_dropout[name]
    return LoRAConfig(r=first.r[name], alpha=first.lora_alpha[name], dropout=drop.p if isinstance(drop, nn.Dropout) else 0.0,
                      target_modules=list(mods), use_rslora=first.use_rslora[name])


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _names(keys: list[str], limit: int = 4) -> str:
    return "[" + ", ".join(keys[:limit]) + (f", ... {len(keys) - limit} more" if len(keys) > limit else "") + "]"


def mismatch_error(missing: list[str], unexpected: list[str], wrong: list[str]) -> InputError:
    return InputError(f"adapter does not fit this model: missing {_names(missing)}, "
                      f"unexpected {_names(unexpected)}, wrong shape {_names(wrong, 2)}")


def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                         adapter_name: str | None = None) -> LoadResult:
    """Copy adapter tensors into the model's LoRA parameters (nothing else is touched).

    A wrong shape is always an InputError; missing or unexpected keys are one when strict. The error
    names the keys, e.g. an adapter trained for another base or with another rank.
    """
    expected = lora_state_dict(model, adapter_name)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(f"{k} (file {tuple(state_dict[k].shape)}, model {tuple(expected[k].shape)})"
                   for k in set(expected) & set(state_dict) if state_dict[k].shape != expected[k].shape)
    if wrong or (strict and (missing or unexpected)):
        raise mismatch_error(missing, unexpected, wrong)
    for k in sorted(set(expected) & set(state_dict)):
        if not state_dict[k].is_floating_point():
            raise InputError(f"adapter tensor {k} is {str(state_dict[k].dtype).removeprefix('torch.')}; LoRA factors "
                             "are floating point")
        if not torch.isfinite(state_dict[k]).all():
            raise InputError(f"adapter tensor {k} has non-finite values (NaN or inf)")
    with torch.no_grad():
        for k in set(expected) & set(state_dict):
            expected[k].copy_(state_dict[k])
    return LoadResult(missing, unexpected)


def merge_lora(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a float nn.Linear holding W + ΔW (dequantizing a quantized base)."""
    for path, m in lora_modules(model).items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, m.merged_linear())
    return model


def unload(model: nn.Module) -> nn.Module:
    """Remove the adapters: put every base layer back where its LoRALinear was (unmerging first)."""
    for path, m in lora_modules(model).items():
        m.unmerge()
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, m.base_layer)
    return model


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

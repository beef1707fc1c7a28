"""bf16 compute for LoRA and QLoRA: the frozen base held in bf16, the LoRA masters, norms, softmax and loss in fp32.

    model = load_base(...) ; apply_lora(model, cfg)          # or wrap_minigpt_qlora(..., compute_dtype=fp32)
    apply_precision(model, "bf16", device, allow_slow_bf16)   # check_bf16 (refuse slow bf16), then
                                                              # use_bf16_compute(model); then the optimizer

What changes, module by module (module swaps and hooks; in the model code only ``Decoder.compute_dtype``,
the dtype RoPE is applied in; the residual stream stays fp32):
- a frozen ``nn.Linear`` becomes a ``Bf16Linear``: its weight (and bias) stored in bf16 once, never cast
  per call; it computes in bf16 and returns bf16 when fed bf16 (an fp32 input is cast in and the result
  cast back);
- a frozen ``nn.Embedding`` becomes a ``CastEmbedding``: a bf16 table, fp32 rows out (the stream). A weight
  shared by several modules (MiniGPT's ``lm_head`` tied to ``wte``) becomes one shared bf16 parameter: still
  tied;
- a ``QuantizedLinear`` computes in bf16 (``compute_dtype``): NF4 dequantizes straight to bf16 into a
  workspace reused by every layer (miniquant.quantize), its bias is stored in bf16;
- a ``LoRALinear`` runs the base and the LoRA path in bf16 (the fp32 masters A and B are cast per call:
  r × in values, and autograd returns their gradients in fp32; on a CPU with AVX512-BF16 the C of
  ``minituner.native_lora`` rounds them as it reads them and sums their gradients in fp32) and returns its
  input's dtype;
- norms (LayerNorm, RMSNorm) compute in fp32 on the fp32 residual stream and hand their output to the
  products that follow in bf16: one cast per norm, shared by q/k/v or gate/up, where each product casting its
  own input would cast the same tensor three times. The decoder's RMSNorm becomes a ``Bf16OutRMSNorm`` and an
  ``nn.LayerNorm`` a ``Bf16OutLayerNorm`` (the same weight and bias), whose norm and cast are one pass of C each
  way on CPU (``minigpt.native_norm``); any other norm (torch's ``nn.RMSNorm``) gets a forward hook that casts
  (``_hand_out_bf16``);
- so the block between a norm and the residual add is bf16 end to end: q, k, v and attention (on CPU
  ``minigpt.native_attention``: q·kᵀ and P·v as bf16 GEMMs, the softmax and its gradient computed in fp32 in C,
  the probabilities rounded to bf16 for the product with v; elsewhere, and past its 1,024 tokens,
  ``scaled_dot_product_attention``'s fused kernel, which also keeps q·kᵀ in fp32), RoPE (``Decoder.compute_dtype``: cos and sin made in fp32, applied in bf16, as
  transformers does for a bf16 model), GELU / SwiGLU, and the projections back; ``x + f(x)`` adds the bf16
  output into the fp32 stream (type promotion: fp32 result, no separate cast); the norm after each add does that
  add itself (``minigpt.residual``: a block's second norm, then the next block's first norm or the final norm), in
  the same pass of C as the norm (``add_and_norm``), and in backward hands the branch its bf16 gradient from that
  pass too;
- a frozen head computes in bf16 and returns bf16 logits (it reads the final norm's bf16 output), as a
  transformers model in bf16 does (on CPU, 32 MiB of them or more are written into fresh huge pages:
  ``minikernels.large_output``, for any Bf16Linear, and for an Fp32Linear where PyTorch's own library
  multiplies; a bf16 training run's head writes into its last step's logits again once nothing holds them,
  ``keep_head_output``); the loss (``minigpt.cross_entropy``) computes in fp32 a few rows at a time and hands
  back a bf16 gradient, so no (N, V) tensor is ever fp32. AdamW holds fp32 state for the fp32 masters.

In fp32 (``use_fp32_products``, what ``build_for_training`` does for every method in fp32), an fp32
``nn.Linear`` other than a LoRA factor (the frozen base of LoRA and QLoRA, every Linear of a full fine-tune)
becomes an ``Fp32Linear``: the same Parameters, its products and their gradients through
``minikernels.fp32_gemm`` (oneDNN on CPUs where PyTorch's MKL takes slow kernels; ``F.linear``'s products
elsewhere, with a trainable weight's gradient made fresh by fp32_gemm's Function on either library).

A 16-bit checkpoint computing in fp32 keeps its weights as read: ``minituner.upcast``.

Full fine-tuning is refused: bf16 compute is defined for a frozen base (every trainable parameter a LoRA
factor); full fine-tuning trains in fp32. The same path runs on CUDA (cuBLAS bf16 products).
"""
from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt import native_norm
from minigpt.bf16_support import Bf16Support
from minigpt.decoder import RMSNorm
from minigpt.device import PRECISIONS, check_precision
from minigpt.errors import InputError
from minikernels import fp32_gemm, large_output
from miniquant import QuantizedLinear

from .lora import OUTPUT_HEADS, LoRALinear, lora_modules
from .qlora import cast_float_tensors

BF16 = torch.bfloat16
# computed in fp32 on the stream; their output handed out in bf16 (nn.RMSNorm exists from torch 2.4 on)
NORMS = (nn.LayerNorm, RMSNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


class Bf16Linear(nn.Linear):
    """A frozen Linear whose weight and bias are stored in a low-precision dtype; returns its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if large_output.takes(x, w, self.bias):  # a large vocabulary's logits: into huge pages (keep_head_output)
            return large_output.linear(x, w, self.bias, self.__dict__.get("_output_store"))
        y = F.linear(x.to(w.dtype), w, self.bias)  # (..., out), computed in w.dtype (a no-op cast when x is)
        return y.to(x.dtype)


class Fp32Linear(nn.Linear):
    """An fp32 Linear, frozen or trainable, whose products take minikernels.fp32_gemm (oneDNN on CPUs where MKL
    is slow; F.linear's elsewhere, a trainable weight's gradient through fp32_gemm's Function)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp32_gemm.backend() == "aten" and large_output.takes(x, self.weight, self.bias):  # (oneDNN's: no out=)
            return large_output.linear(x, self.weight, self.bias)  # a large vocabulary's logits: in huge pages
        return fp32_gemm.linear(x, self.weight, self.bias)  # (..., out); F.linear off fp32 CPU


class CastEmbedding(nn.Embedding):
    """A frozen Embedding whose table stays in the dtype it is stored in (bf16 or fp16, as read or as
    use_bf16_compute stores it) and returns `output_dtype` rows: each lookup casts the rows it reads."""

    output_dtype: torch.dtype = torch.float32

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx).to(self.output_dtype)  # (..., C)


class Bf16OutRMSNorm(RMSNorm):
    """The decoder's RMSNorm computing in fp32 on the stream and handing out `_output_dtype` (bf16): one pass of C
    each way (``minigpt.native_norm``) where it takes the input, else RMSNorm's PyTorch ops and one cast."""

    _output_dtype: torch.dtype = BF16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._output_dtype == BF16 and native_norm.fits(x, self.weight):
            return native_norm.rms_norm_bf16(x, self.weight, self.eps)  # (..., C) bf16
        return super().forward(x).to(self._output_dtype)

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + branch, self(x + branch)) in one pass of C each way where it takes them (minigpt.residual); None:
        not taken."""
        if self._output_dtype == BF16 and native_norm.fits(x, self.weight) and native_norm.add_fits(x, branch):
            return native_norm.add_rms_norm_bf16(x, branch, self.weight, self.eps)
        return None


class Bf16OutLayerNorm(nn.LayerNorm):
    """A LayerNorm computing in fp32 on the stream and handing out `_output_dtype` (bf16): one pass of C each way
    (``minigpt.native_norm``) where it takes the input, else ``F.layer_norm`` and one cast."""

    _output_dtype: torch.dtype = BF16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._output_dtype == BF16 and len(self.normalized_shape) == 1
                and native_norm.layer_norm_fits(x, self.weight, self.bias)):
            return native_norm.layer_norm_bf16(x, self.weight, self.bias, self.eps)  # (..., C) bf16
        return super().forward(x).to(self._output_dtype)

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + branch, self(x + branch)) in one pass of C each way where it takes them (minigpt.residual); None:
        not taken."""
        if (self._output_dtype == BF16 and len(self.normalized_shape) == 1
                and native_norm.layer_norm_fits(x, self.weight, self.bias) and native_norm.add_fits(x, branch)):
            return native_norm.add_layer_norm_bf16(x, branch, self.weight, self.bias, self.eps)
        return None


def _bf16_out_layernorm(m: nn.LayerNorm, dtype: torch.dtype) -> Bf16OutLayerNorm:
    """A Bf16OutLayerNorm in m's place holding m's weight and bias (the same Parameters), shape and eps."""
    norm = Bf16OutLayerNorm.__new__(Bf16OutLayerNorm)
    nn.Module.__init__(norm)
    norm.normalized_shape, norm.eps, norm.elementwise_affine = m.normalized_shape, m.eps, m.elementwise_affine
    norm.weight, norm.bias, norm._output_dtype = m.weight, m.bias, dtype
    norm.train(m.training)
    return norm


def _bf16_out_rmsnorm(m: RMSNorm, dtype: torch.dtype) -> Bf16OutRMSNorm:
    """A Bf16OutRMSNorm in m's place holding m's weight (the same Parameter) and eps."""
    norm = Bf16OutRMSNorm.__new__(Bf16OutRMSNorm)
    nn.Module.__init__(norm)
    norm.weight, norm.eps, norm._output_dtype = m.weight, m.eps, dtype
    norm.train(m.training)
    return norm


def _cast_output(dtype: torch.dtype, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A forward hook's body: the module's output in dtype (a module-level function, so the model pickles)."""
    return out.to(dtype)


def _hand_out_bf16(norm: nn.Module, dtype: torch.dtype) -> None:
    """Cast `norm`'s output to dtype (a forward hook, once per module): the norm computes in fp32, the products
    after it read one bf16 copy of its output."""
    if getattr(norm, "_output_dtype", None) is None:
        norm._output_dtype = dtype
        norm.register_forward_hook(partial(_cast_output, dtype))


def _frozen_copy(param: nn.Parameter, dtype: torch.dtype, cache: dict[int, nn.Parameter]) -> nn.Parameter:
    """`param` cast to dtype as a frozen Parameter; one object per source parameter, so ties stay ties."""
    if id(param) not in cache:
        cache[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
    return cache[id(param)]


def linear_as(cls: type[nn.Linear], m: nn.Linear, weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """A `cls` in m's place holding the given weight and bias (no fresh initialisation)."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = m.in_features, m.out_features
    layer.weight, layer.bias = weight, bias
    layer.train(m.training)
    return layer


def _bf16_linear(m: nn.Linear, dtype: torch.dtype, cache: dict[int, nn.Parameter]) -> Bf16Linear:
    bias = None if m.bias is None else _frozen_copy(m.bias, dtype, cache)
    return linear_as(Bf16Linear, m, _frozen_copy(m.weight, dtype, cache), bias)


def _fp32_linear(m: nn.Linear) -> Fp32Linear:
    return linear_as(Fp32Linear, m, m.weight, m.bias)  # the same Parameters: ties stay ties, nothing copied


def keep_head_output(model: nn.Module) -> int:
    """A bf16 training run on CPU: the output head (a Bf16Linear named in ``OUTPUT_HEADS``) writes its large logits
    into the memory of the last step's once nothing holds them (``large_output.OutputStore``), not into fresh
    pages, except while the model checkpoints its blocks (``model.grad_checkpoint``, looked at each forward): then
    logits kept from the last step would sit beside the recomputed block at the step's peak, as ``planner/peak.py``
    counts them. A forward pre-hook on the model; returns how many heads (once per model)."""
    heads = [m for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] in OUTPUT_HEADS and type(m) is Bf16Linear]
    if not heads or getattr(model, "_keeps_head_output", False):
        return 0

    def follow_checkpointing(module: nn.Module, args: tuple) -> None:
        keep = not getattr(module, "grad_checkpoint", False)
        for head in heads:
            if not keep:
                head.__dict__.pop("_output_store", None)  # (the logits kept, if unheld, freed now)
            elif "_output_store" not in head.__dict__:
                head.__dict__["_output_store"] = large_output.OutputStore()

    model.register_forward_pre_hook(follow_checkpointing)
    model._keeps_head_output = True
    return len(heads)


def kept_output_bytes(model: nn.Module) -> int:
    """Bytes of the logits the model's heads keep from step to step (``keep_head_output``)."""
    return sum(m.__dict__["_output_store"].kept_bytes() for m in model.modules() if "_output_store" in m.__dict__)


def embedding_as(m: nn.Embedding, weight: nn.Parameter, output_dtype: torch.dtype) -> CastEmbedding:
    """A CastEmbedding in m's place holding the given table (no fresh initialisation), returning output_dtype."""
    layer = CastEmbedding.__new__(CastEmbedding)
    nn.Module.__init__(layer)
    for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                 "sparse"):
        setattr(layer, attr, getattr(m, attr))
    layer.weight = weight
    layer.output_dtype = output_dtype
    layer.train(m.training)
    return layer


def _bf16_embedding(m: nn.Embedding, dtype: torch.dtype, output_dtype: torch.dtype,
                    cache: dict[int, nn.Parameter]) -> CastEmbedding:
    return embedding_as(m, _frozen_copy(m.weight, dtype, cache), output_dtype)


def lora_factor_modules(model: nn.Module) -> set[int]:
    """ids of the LoRA factor modules (lora_A / lora_B nn.Linears): the fp32 masters, never converted."""
    return {id(f) for m in lora_modules(model).values() for d in (m.lora_A, m.lora_B) for f in d.values()}


def _non_fp32_tensors(model: nn.Module) -> list[str]:
    """Float parameters and buffers that are not fp32, outside the modules use_bf16_compute made low-precision."""
    out = []
    for path, m in model.named_modules():
        if isinstance(m, (Bf16Linear, CastEmbedding, QuantizedLinear)) or type(m) in (nn.Linear, Fp32Linear, nn.Embedding):
            continue  # low precision by design, or about to be stored in it (a 16-bit checkpoint's weights)
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t is not None and t.is_floating_point() and t.dtype != torch.float32:
                out.append(f"{path}.{name}" if path else name)
    return out


def check_frozen_base(model: nn.Module) -> None:
    """InputError unless every trainable parameter is a LoRA factor (bf16 compute needs a frozen base)."""
    masters = {id(p) for m in lora_modules(model).values() for d in (m.lora_A, m.lora_B) for f in d.values()
               for p in f.parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in masters]
    if trainable:
        more = f" and {len(trainable) - 3} more" if len(trainable) > 3 else ""
        raise InputError(f"bf16 compute needs a frozen base, but {', '.join(trainable[:3])}{more} would train: "
                         "full fine-tuning trains in fp32 (--precision fp32)")


def swap_modules(model: nn.Module, replacements: list[tuple[str, nn.Module]]) -> None:
    """Put each (dotted path, module) in its place in model."""
    for path, new in replacements:
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)


LOW_BITS = (torch.bfloat16, torch.float16)


def dtype_of_most_values(sizes: Iterable[tuple[torch.dtype, int]]) -> torch.dtype:
    """The float dtype holding the most values among (dtype, numel) pairs; float32 when there is none."""
    counts: dict[torch.dtype, int] = {}
    for dtype, numel in sizes:
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + numel
    return max(counts, key=counts.get) if counts else torch.float32


def use_fp32_products(model: nn.Module) -> nn.Module:
    """Make every fp32 nn.Linear but the LoRA factors an Fp32Linear (its products, and the gradients autograd asks
    for, through minikernels.fp32_gemm); in place.

    The weights are not touched or copied, only the module's class: on a CPU where oneDNN is not chosen, and
    off CPU, an Fp32Linear computes the products nn.Linear does (on CPU a trainable weight's gradient made fresh,
    not F.linear's view, and differentiable once: see minikernels.fp32_gemm). Returns the model. Idempotent.
    """
    lora_factors = lora_factor_modules(model)  # thin products: left to F.linear
    swap_modules(model, [(path, _fp32_linear(m)) for path, m in model.named_modules()
                  if type(m) is nn.Linear and id(m) not in lora_factors and m.weight.dtype == torch.float32])
    return model


def inference_precision(requested: str, preferred: str, support: Bf16Support) -> str:
    """What ``generate`` and ``eval`` compute in: "fp32" or "bf16" as given; "auto" the `preferred` one, but bf16 only
    on a device with bf16 units. generate prefers bf16 for a checkpoint stored in bf16 (as stored, as transformers
    computes a bf16 model; no weight cast per product, so each token reads half the bytes: 0.42x the fp32 time a
    token at Llama-3.2-1B's shape on an Intel Xeon with AMX, benchmarks/RESULTS.md); eval prefers the precision
    the adapter's run trained in (so its val loss is the run's)."""
    if requested not in ("auto", *PRECISIONS):
        raise InputError(f"precision must be auto, {' or '.join(PRECISIONS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "bf16" if preferred == "bf16" and support.fast else "fp32"


def stored_precision(model: nn.Module) -> str:
    """"bf16" for a model whose base values are mostly bf16 (a bf16 checkpoint as read), else "fp32"; an adapter's
    fp32 factors do not count (a QLoRA model's float parameters are few: a large rank could outweigh them)."""
    base = ((p.dtype, p.numel()) for name, p in model.named_parameters() if "lora_" not in name)
    return "bf16" if dtype_of_most_values(base) == BF16 else "fp32"


def compute_in_bf16(model: nn.Module) -> nn.Module:
    """A loaded model (with any adapters) frozen and computing as bf16 training computes (``use_bf16_compute``): the
    Linears and embedding in bf16 (a bf16 checkpoint's as read), norms and the residual stream in fp32; in place."""
    model.requires_grad_(False)
    cast_float_tensors(model, torch.float32, keep=(nn.Linear, nn.Embedding))  # norms fp32; the rest as read
    return use_bf16_compute(model)


@torch.no_grad()
def use_bf16_compute(model: nn.Module, dtype: torch.dtype = BF16) -> nn.Module:
    """Compute the frozen base and the LoRA path in `dtype` (default bf16), keep fp32 elsewhere; in place.

    Call after LoRA/QLoRA wrapping and before building the optimizer (the LoRA masters are not replaced, so
    an optimizer built before still holds them). Returns the model. Idempotent.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"low-precision compute dtype must be bfloat16 or float16, got {dtype}")
    check_frozen_base(model)
    earlier = {getattr(m, "_output_dtype", None) for m in model.modules() if isinstance(m, NORMS)} - {None, dtype}
    if earlier:
        raise InputError(f"this model already computes in {earlier.pop()}; build it again for {dtype}")
    low = _non_fp32_tensors(model)
    if low:
        raise InputError(f"bf16 compute starts from an fp32 model (norms stay fp32), but {low[0]} is not fp32: "
                         "build the model in fp32 (e.g. wrap_minigpt_qlora(..., compute_dtype=torch.float32))")
    cache: dict[int, nn.Parameter] = {}
    output_dtype = torch.float32
    lora_factors = lora_factor_modules(model)
    replacements = []  # (path, new module): swapped in after the walk
    for path, m in model.named_modules():
        if id(m) in lora_factors:
            continue  # the fp32 masters
        if isinstance(m, LoRALinear):
            m.compute_dtype = dtype
        elif isinstance(m, QuantizedLinear):
            m.compute_dtype = dtype
            if m.bias is not None:
                m.bias = m.bias.to(dtype)  # a buffer: stored once in dtype, not cast per call
        elif type(m) in (nn.Linear, Fp32Linear):
            replacements.append((path, _bf16_linear(m, dtype, cache)))
        elif type(m) is nn.Embedding:
            replacements.append((path, _bf16_embedding(m, dtype, output_dtype, cache)))
        elif type(m) is RMSNorm:
            replacements.append((path, _bf16_out_rmsnorm(m, dtype)))
        elif type(m) is nn.LayerNorm:
            replacements.append((path, _bf16_out_layernorm(m, dtype)))
        elif isinstance(m, NORMS):
            _hand_out_bf16(m, dtype)
    if hasattr(model, "compute_dtype"):  # a Decoder: RoPE applied in the products' dtype
        model.compute_dtype = dtype
    swap_modules(model, replacements)
    return model


def compute_dtypes(model: nn.Module) -> dict[str, str]:
    """Where each kind of tensor lives: for reports and checks (e.g. {'frozen linear weights': 'bfloat16'})."""
    kinds: dict[str, set[str]] = {}
    add = lambda kind, t: kinds.setdefault(kind, set()).add(str(t).removeprefix("torch."))  # noqa: E731
    factors = lora_factor_modules(model)
    for m in model.modules():
        if id(m) in factors:
            continue
        if isinstance(m, LoRALinear):
            add("LoRA compute", m.compute_dtype or "input dtype")
            for d in (m.lora_A, m.lora_B):
                for f in d.values():
                    add("LoRA masters", f.weight.dtype)
        elif isinstance(m, QuantizedLinear):
            add("quantized linear compute", m.compute_dtype or "input dtype")
        elif isinstance(m, nn.Linear):
            add("frozen linear weights", m.weight.dtype)
        elif isinstance(m, nn.Embedding):
            add("embeddings", m.weight.dtype)
        elif isinstance(m, NORMS) and m.weight is not None:
            add("norms", m.weight.dtype)
    return {k: ", ".join(sorted(v)) for k, v in kinds.items()}


def apply_precision(model: nn.Module, precision: str, device: torch.device | str = "cpu",
                    allow_slow_bf16: bool = False, flags=None) -> Bf16Support | None:
    """One call for a training command: "fp32" changes nothing; "bf16" refuses a device without bf16 units
    (one-line InputError, unless allow_slow_bf16) and then calls use_bf16_compute. Returns what was found."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    check_frozen_base(model)  # a full fine-tune is refused before the device is looked at
    support = check_precision(precision, device, allow_slow_bf16, flags)
    use_bf16_compute(model)
    return support

"""bf16 training steps (issue 13): ours (use_bf16_compute) against PEFT + bitsandbytes under CPU autocast, and the floor.

For each model shape (SHAPES: a builder of the float base model plus its batch; the GPT-shaped stack of
bench_step.py and Llama-3.2-1B cut to LLAMA_LAYERS of its 16 layers, a section each) every configuration
(CONFIGS) and the floor run in a subprocess of their own, in groups (row_groups: the goals' rows, then the rest)
whose members are alive together, and their optimizer steps are timed in turns (paced.run_paced: each turn gives
every row SETTLE_STEPS untimed steps and one timed step, who goes first rotating), so load from other processes
falls on all rows alike, while each row has its process to itself
as a training run does: its own heap, and the allocator settings its library leaves (ours: build_for_training's
keep_freed_memory and heap trims, minituner.memory.heap; PEFT's: glibc's defaults, as transformers leaves them).
After the timed turns each row profiles one more step of its own. Rows: our LoRA and QLoRA in fp32 and in
bf16, PEFT + bitsandbytes QLoRA in fp32 and with compute_dtype bf16 under torch.autocast, the rest of its model
in fp32 or in bf16 (as from_pretrained(dtype=bfloat16) loads it); its best CPU setting is the faster of those
two, and the goal takes it. Every row starts from the same weights and batch. Each side computes its loss its own way: ours with
minigpt.train.lm_loss (as finetune does), theirs as transformers does (the logits upcast to fp32). The PEFT
rows run our model code with bitsandbytes' Linear4bit swapped in; they attend as transformers' models do on CPU,
through F.scaled_dot_product_attention (minigpt.native_attention switched off for them), and one informational
row gives the bf16 one our attention instead, to show what that alone is worth.

The floor: one step of our QLoRA bf16 runs under a TorchDispatchMode that records every matrix product
(aten::mm, addmm, addmm_, bmm, baddbmm) with its shapes, strides and dtypes, and with the calls of
minituner.native_lora (the adapters' thin products in C) recorded alike, and each NF4 input gradient that
miniquant.nf4_matmul computes in C recorded as the aten::mm PyTorch would run from the weight in bf16 (the NF4
unpacking inside it left out of the floor), with the adapter's share it adds inside as native_lora's call that
adds it elsewhere, and each product miniquant.nf4_amx runs on AMX's tiles recorded as its own GEMM (the weight's
writing into the tiles' layout left out, as dequantization is), and each product of a larger NF4 weight that
miniquant.nf4_brgemm runs (W unpacked panel by panel inside, multiplied by oneDNN's brgemm) recorded as that call,
replayed with unpack=False: the same brgemm calls on whatever its buffers hold, the unpacking left out as
dequantization is; the floor row replays them all,
back to back, on random inputs of the same layouts (in its own process: the model it recorded is dropped first),
timed in the same turns as the steps.
Our attention's q·kᵀ and P·v are bf16 GEMMs (aten::bmm) and count among the products; its C softmax, and
SDPA's fused kernel in the PEFT rows, are reported apart. On a CPU with bf16 units (AVX512-BF16, or AMX's tiles)
our attention runs as one C call for the forward and one for the backward (minigpt.fused_attention): the floor
replays each with its softmax left out (gemms_only: its products and the packing of their operands).
The fixed cost of a step: FIXED_ROWS (ours QLoRA bf16, PEFT + bitsandbytes with the model in bf16) also run, in
the same turns and processes of their own, on each shape's small variant (SMALL_SHAPES: the same layers, targets
and rank at a small width, 16 tokens), whose arithmetic is next to nothing: what is left, Python, PyTorch's dispatch
and autograd around each op and each kernel's call, is paid by a step of these layers at any width, and the floor
goal says how much of our rest over the floor it is.
Each goal is a ratio of two rows' medians; its text gives the same ratio turn by turn as well (median and range
of the per-turn ratios, timing.per_turn_ratio), which a slow phase of the machine spanning several turns leaves
alone where it moves the medians.
On a CPU without bf16 units (minigpt.bf16_support) the bf16 goals are reported as not measurable here.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from unittest import mock

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_step  # noqa: E402
import real_checkpoints  # noqa: E402
from minigpt import fused_attention, native_attention, native_rope  # noqa: E402
from minigpt.bf16_support import bf16_support  # noqa: E402
from minigpt.decoder import Decoder  # noqa: E402
from minigpt.model import MiniGPT  # noqa: E402
from minigpt.train import lm_loss  # noqa: E402
from miniquant import nf4_amx, nf4_brgemm, nf4_matmul  # noqa: E402
from minituner import native_lora, native_lora_fp32  # noqa: E402
from minituner.hf_config import decoder_config_from_hf  # noqa: E402
from report import Goal, Section  # noqa: E402
from minituner.memory.heap import trim_now  # noqa: E402
from paced import run_paced  # noqa: E402
from timing import (OPTIMIZER_NOTE, adamw, fmt_ratio, fmt_seconds, peak_rss_mib, per_turn_ratio,  # noqa: E402
                    reset_peak_rss, wait_for_quiet)

VS_PEFT_BNB_GOAL = 0.5  # our QLoRA bf16 step / PEFT + bitsandbytes bf16 (autocast) step
VS_FLOOR_GOAL = 1.3  # our QLoRA bf16 step / the sum of its matrix products timed alone
VS_LORA_GOAL = 1.10  # our QLoRA bf16 step / our LoRA bf16 step
WAIT_PER_CONFIG_S = 60.0
# untimed steps of a row right before each of its timed ones: a training step follows its own last step, not another
# process's (whose caches it would inherit, and whose OpenMP threads may still spin for a while)
SETTLE_STEPS = 1
# Why a process per row: with every row in one process (the layout until 2026-12-04) their heap was shared, and what
# the other rows left free in it set off our forward's heap trims (minituner.memory.heap) at every step, which then
# faulted the pages they handed back in again. On the gpt shape ours QLoRA bf16 took 251 ms a step there (8,000
# page faults a step) against 214 ms for the same model without its trims (300 faults), medians of 10 interleaved
# rounds with one settling step each (AMD EPYC, 2 cores, 2026-12-04); alone in its process it faults 7 pages a step.
LR = 1e-4
# The fixed cost of a step: FIXED_ROWS also run on the shape's small variant (SMALL_SHAPES: the same layers, targets
# and rank at a small width, SMALL_TOKENS tokens), where the arithmetic is next to nothing and what is left is what a
# step pays whatever its shape: Python, PyTorch's dispatch and autograd around each op, each kernel's call. The widths
# keep every quantized weight at NF4's native size or more (miniquant.nf4.NATIVE_MIN_ELEMENTS), as at full size.
SMALL_TOKENS = 16
FIXED_SUFFIX = "@small"
FIXED_ROWS = ("qlora_bf16", "peft_bnb_bf16_base")  # ours, and PEFT + bitsandbytes with the model in bf16


@dataclass(frozen=True)
class Shape:
    """A model shape to benchmark: how to build its float base (seeded by the caller) and its batch."""

    describe: str  # one line for the report
    build: Callable[[], nn.Module]  # a float32 base model; forward(idx (B, T)) -> logits (B, T, V)
    vocab: int
    batch: int
    seq: int
    targets: tuple[str, ...]  # LoRA (and NF4) targets
    rank: int = 8
    alpha: float = 16.0
    note: str = ""  # a note under the section's table (e.g. why a shape is cut short)
    turns: int = 7  # timed steps of each row (paced turns): more where steps are short, the medians steadier


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # not lm_head
LLAMA_LAYERS = 6  # of Llama-3.2-1B's 16, for the bench time and memory (LLAMA_NOTE)
# paced turns of the llama-1b shape: its goals' per-turn ratios ranged 1.29-1.49 over 7 turns (2026-12-06), the
# medians of 7 moving with the machine's pace; each turn adds about 50 s to the section
LLAMA_TURNS = 11
LLAMA_NOTE = (
    f"{LLAMA_LAYERS} of Llama-3.2-1B's 16 layers: every row runs in every turn of its group, in a process of its "
    "own, the group's rows alive together, so the section's time and memory grow with each layer; sized to fit a "
    "23 GiB machine (each process's peak is in the note above; in matrix-product FLOPs the tied lm_head over "
    "128,256 tokens weighs about 4 layers)")


def llama_1b(n_layer: int, vocab: int | None = None, note: str = "", turns: int = 7) -> Shape:
    """Llama-3.2-1B (real_checkpoints' config.json, through hf_config) cut to n_layer layers (and `vocab` tokens).

    A random-init minigpt.decoder.Decoder in float32; batch 1 × 512 tokens, LoRA r 16, alpha 32 (as in
    bench_real_models) on the seven Linears of every layer.
    """
    hf = {**real_checkpoints.SHAPES["llama-3.2-1b"], "num_hidden_layers": n_layer}
    if vocab is not None:
        hf["vocab_size"] = vocab
    cfg = decoder_config_from_hf(hf)
    tied = "tied embedding and lm_head" if cfg.tie_word_embeddings else "untied lm_head"
    return Shape(
        f"{n_layer} of Llama-3.2-1B's 16 layers (d_model {cfg.d_model}, {cfg.n_head} heads, {cfg.n_kv_head} "
        f"KV heads, SwiGLU d_ff {cfg.d_ff}, vocab {cfg.vocab_size:,}, {tied}), random init, as minigpt.decoder."
        "Decoder; batch 1 × 512 tokens",
        lambda: Decoder(cfg), cfg.vocab_size, 1, 512, LLAMA_TARGETS, rank=16, alpha=32.0, note=note, turns=turns)


def small_gpt() -> Shape:
    """The gpt shape's layers at d_model 128 (4 heads of 32, d_ff 512), batch 1 × 16 tokens: the same ops, next to
    no arithmetic (the fixed cost of a step, FIXED_ROWS); heads of 32, the narrowest minigpt.fused_attention takes,
    so attention takes the full shape's path on every CPU."""
    cfg = replace(bench_step.STACK, d_model=128, n_head=4, d_ff=0)
    return Shape(f"MiniGPT d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, vocab {cfg.vocab_size}; "
                 f"batch 1 × {SMALL_TOKENS} tokens", lambda: MiniGPT(cfg), cfg.vocab_size, 1, SMALL_TOKENS,
                 tuple(bench_step.TARGETS))


def small_llama(n_layer: int) -> Shape:
    """n_layer layers built as Llama-3.2-1B's (grouped-query attention, 4 heads of 64 over 1 K/V head; SwiGLU; RoPE
    llama3; tied head) at d_model 256, d_ff 1,024, vocab 4,096, batch 1 × 16 tokens, LoRA r 16 as llama_1b: the same
    ops, next to no arithmetic (the fixed cost of a step, FIXED_ROWS)."""
    hf = {**real_checkpoints.SHAPES["llama-3.2-1b"], "num_hidden_layers": n_layer, "hidden_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 1024,
          "vocab_size": 4096}
    cfg = decoder_config_from_hf(hf)
    return Shape(f"{n_layer} layer{'s' if n_layer > 1 else ''} built as Llama-3.2-1B's at d_model {cfg.d_model} "
                 f"({cfg.n_head} heads, {cfg.n_kv_head} KV head, SwiGLU d_ff {cfg.d_ff}, vocab {cfg.vocab_size:,}); "
                 f"batch 1 × {SMALL_TOKENS} tokens", lambda: Decoder(cfg), cfg.vocab_size, 1, SMALL_TOKENS,
                 LLAMA_TARGETS, rank=16, alpha=32.0)


SHAPES: dict[str, Shape] = {
    "gpt": Shape(
        f"MiniGPT d_model {bench_step.STACK.d_model}, {bench_step.STACK.n_layer} layers, {bench_step.STACK.n_head} "
        f"heads, vocab {bench_step.STACK.vocab_size}; batch {bench_step.BATCH} × {bench_step.STACK.block_size} tokens",
        lambda: MiniGPT(bench_step.STACK), bench_step.STACK.vocab_size, bench_step.BATCH, bench_step.STACK.block_size,
        tuple(bench_step.TARGETS), turns=21),
    "llama-1b": llama_1b(LLAMA_LAYERS, note=LLAMA_NOTE, turns=LLAMA_TURNS),
    # the quick run's stand-in: the same code path in seconds
    "llama-1b-tiny": llama_1b(1, vocab=8192, note="a smoke-run stand-in for the llama-1b shape: 1 layer, vocab 8,192"),
}
# each bench shape's small variant: the same layers and LoRA at a small width, 16 tokens (FIXED_ROWS)
SMALL_SHAPES: dict[str, Callable[[], Shape]] = {"gpt": small_gpt, "llama-1b": lambda: small_llama(LLAMA_LAYERS),
                                                "llama-1b-tiny": lambda: small_llama(1)}
BENCH_SHAPES = ("gpt", "llama-1b")  # a section each, in this order
QUICK_SHAPES = ("gpt", "llama-1b-tiny")


# name -> label, in the order of the table (and of the first round)
CONFIGS = {
    "lora_fp32": "ours, LoRA fp32",
    "qlora_fp32": "ours, QLoRA fp32",
    "peft_bnb_fp32": "PEFT + bitsandbytes QLoRA, fp32",
    "lora_bf16": "ours, LoRA bf16 (use_bf16_compute)",
    "qlora_bf16": "ours, QLoRA bf16 (use_bf16_compute)",
    "peft_bnb_bf16": "PEFT + bitsandbytes QLoRA, compute_dtype bf16 under CPU autocast",
    "peft_bnb_bf16_base": "PEFT + bitsandbytes QLoRA, model in bf16 (as from_pretrained(dtype=bf16)), compute_dtype "
                          "bf16 under CPU autocast",
    "peft_bnb_bf16_base_our_attention": "informational: the row above with our attention (minigpt.native_attention) "
                                        "instead of SDPA",
}
FP32_CONFIGS = ("lora_fp32", "qlora_fp32", "peft_bnb_fp32")  # all a CPU without bf16 units runs (see measure)
PEFT_BF16 = ("peft_bnb_bf16", "peft_bnb_bf16_base")  # its best CPU setting is the faster of the two
PEFT_SETTING = {"peft_bnb_bf16": "the model in fp32", "peft_bnb_bf16_base": "the model in bf16"}
# the PEFT rows attend as transformers' models do on CPU, through SDPA (minigpt.native_attention switched off),
# except this one, which shows what our attention alone is worth to them
OUR_ATTENTION = ("peft_bnb_bf16_base_our_attention",)


# ---- inside the subprocess ----------------------------------------------------------------------


def build(shape: Shape, config: str) -> nn.Module:
    """The model of one configuration, only its LoRA factors requiring grad."""
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig

    torch.manual_seed(0)
    model = shape.build()
    if config.startswith(("lora", "qlora")):  # ours as `finetune --precision fp32|bf16` builds it
        bf16 = config.endswith("bf16")
        build_for_training(model, config.split("_")[0], LoRAConfig(r=shape.rank, alpha=shape.alpha,
                                                                    target_modules=list(shape.targets)),
                           device="cpu", compute_dtype=torch.float32, precision="bf16" if bf16 else "fp32",
                           allow_slow_bf16=True)
    elif config.startswith("peft_bnb"):
        from peft import LoraConfig, get_peft_model

        dtype = torch.bfloat16 if config in (*PEFT_BF16, *OUR_ATTENTION) else torch.float32
        if config in ("peft_bnb_bf16_base", *OUR_ATTENTION):  # embeddings, norms and head in bf16; NF4 quantized from bf16 weights,
            model.to(torch.bfloat16)  # as transformers loads a bf16 checkpoint with load_in_4bit
        for path in [n for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in shape.targets]:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, bench_step._bnb_linear4bit(model.get_submodule(path), dtype))
        model = get_peft_model(model, LoraConfig(r=shape.rank, lora_alpha=shape.alpha,
                                                 target_modules=list(shape.targets), lora_dropout=0.0))
    else:
        raise ValueError(f"unknown configuration {config!r}; valid: {list(CONFIGS)}")
    return model


MM_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")


def _product_ops() -> dict:
    """op -> name: aten's products, also into a given tensor ("bmm.out": minigpt.native_attention writes four of
    its six products so; "mm.out": minikernels.large_output the head's logits, into huge pages, the last step's
    again once spent, where the replay writes into one tensor made before, as for every output it gives), and
    oneDNN's linear, which the fp32 rows' frozen products take (minikernels.fp32_gemm)."""
    ops = {}
    for name in MM_OPS:
        packet = getattr(torch.ops.aten, name)
        ops[packet.default] = name
        if "out" in packet.overloads():
            ops[packet.out] = f"{name}.out"
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        ops[torch.ops.mkldnn._linear_pointwise.default] = "mkldnn_linear"
    return ops


def _spec(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), str(a.dtype).removeprefix("torch."))
    if isinstance(a, list):  # hashable; the op takes a tuple for a list
        return tuple(_spec(x) for x in a)
    if isinstance(a, tuple) and any(isinstance(x, torch.Tensor) for x in a):  # (nf4_brgemm's adapter=(xa, wa, s))
        return ("tensors", tuple(_spec(x) for x in a))
    return a


NATIVE_LORA = ("forward_", "down", "backward", "input_update_")  # the C kernels' calls: matrix products in C
NATIVE_MODULES = {"native_lora": native_lora, "native_lora_fp32": native_lora_fp32}  # bf16 and fp32 kernels


def _native_module(kernels: native_lora.NativeLoRA) -> str:
    """The module a NativeLoRA instance comes from: both families share the class, each with its own dtype."""
    return "native_lora" if kernels.dtype == torch.bfloat16 else "native_lora_fp32"


@contextmanager
def _methods_wrapped(cls: type, names: tuple[str, ...], wrap: Callable[[str, Callable], Callable]):
    """cls's methods `names` (self first) replaced by wrap(name, method) for the while."""
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(cls, name, wrap(name, getattr(cls, name))))
        yield


def _native_lora_wrapped(wrap: Callable[[str, Callable], Callable]):
    """The C kernels' calls (NativeLoRA's methods; minituner.native_lora's in bf16 and native_lora_fp32's) replaced
    by wrap(name, call) for the while."""
    return _methods_wrapped(native_lora.NativeLoRA, NATIVE_LORA, wrap)


NF4_PRODUCTS = ("input_grad",)  # miniquant.nf4_matmul's calls: an NF4 weight's input gradient, unpacked inside


def _nf4_matmul_wrapped(wrap: Callable[[str, Callable], Callable]):
    """miniquant.nf4_matmul's calls (NF4Matmul's methods) replaced by wrap(name, call) for the while."""
    return _methods_wrapped(nf4_matmul.NF4Matmul, NF4_PRODUCTS, wrap)


NF4_AMX = ("pack", "gemm")  # miniquant.nf4_amx's calls: an NF4 weight into the tiles' layout, and the GEMM on it


def _nf4_amx_wrapped(wrap: Callable[[str, Callable], Callable]):
    """miniquant.nf4_amx's calls (NF4Amx's methods) replaced by wrap(name, call) for the while."""
    return _methods_wrapped(nf4_amx.NF4Amx, NF4_AMX, wrap)


FUSED_ATTENTION = ("forward", "backward")  # minigpt.fused_attention's calls: a layer's attention, one C call each


NF4_BRGEMM = ("product",)  # miniquant.nf4_brgemm's call: a larger NF4 weight unpacked and multiplied, panel by panel


def _nf4_brgemm_wrapped(wrap: Callable[[str, Callable], Callable]):
    """miniquant.nf4_brgemm's calls (NF4Brgemm's methods) replaced by wrap(name, call) for the while."""
    return _methods_wrapped(nf4_brgemm.NF4Brgemm, NF4_BRGEMM, wrap)


def _fused_attention_wrapped(wrap: Callable[[str, Callable], Callable]):
    """minigpt.fused_attention's calls (FusedAttention's methods) replaced by wrap(name, call) for the while."""
    return _methods_wrapped(fused_attention.FusedAttention, FUSED_ATTENTION, wrap)


def _bf16_weight(rows: int, cols: int) -> tuple:
    return ("tensor", (rows, cols), (cols, 1), "bfloat16")


def nf4_products_as_aten(name: str, args: tuple) -> list[tuple[str, tuple]]:
    """(op, argument specs) of the products that run in place of an nf4_matmul call where it is not there: the
    input gradient g·W from the weight dequantized to bf16 (aten::mm of g (N, out) and W (out, in), as
    fp32_gemm.input_grad computes it), and, where the call adds a LoRA adapter's share grad_a·A inside, that thin
    product as minituner.native_lora adds it (its input_update_ on the (N, in) gradient)."""
    g, _, _, _, in_features, *rest = args  # input_grad: (g, packed, absmax, blocksize, in_features[, adapter])
    products = [("mm", (_spec(g), _bf16_weight(g.shape[1], in_features)))]
    if rest and rest[0] is not None:
        grad_a, A = rest[0]
        update = (_bf16_weight(g.shape[0], in_features), _spec(grad_a), _spec(A))  # (grad_x, grad_a, A)
        products.append(("native_lora.input_update_", update))
    return products


def record_products(step: Callable[[], object]) -> Counter:
    """Run step() once, counting each distinct matrix product (op, argument layouts) it dispatches, each call of
    the C kernels ("native_lora.<name>" in bf16, "native_lora_fp32.<name>" in fp32), and each NF4 input gradient in
    C (miniquant.nf4_matmul) as the product PyTorch would run from the weight dequantized to bf16
    (``nf4_products_as_aten``, with the adapter's share it adds as native_lora's call): the floor times it by the
    library PyTorch uses, the NF4 unpacking left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = _product_ops()
    calls: Counter = Counter()

    def counted(name: str, call: Callable) -> Callable:
        def run(self, *args, **kwargs):
            calls[(f"{_native_module(self)}.{name}", tuple(_spec(a) for a in args),
                   tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))] += 1
            return call(self, *args, **kwargs)
        return run

    def counted_nf4(name: str, call: Callable) -> Callable:
        def run(self, *args):
            for op, specs in nf4_products_as_aten(name, args):
                calls[(op, specs, ())] += 1
            return call(self, *args)
        return run

    def counted_amx(name: str, call: Callable) -> Callable:  # its GEMM (not the packing: dequantization)
        def run(self, *args):
            if name == "gemm":
                calls[(f"nf4_amx.{name}", tuple(_spec(a) for a in args), ())] += 1
            return call(self, *args)
        return run

    def counted_brgemm(name: str, call: Callable) -> Callable:  # replayed with unpack=False (_replay_op)
        def run(self, *args, **kwargs):
            calls[(f"nf4_brgemm.{name}", tuple(_spec(a) for a in args),
                   tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))] += 1
            return call(self, *args, **kwargs)
        return run

    def counted_attention(name: str, call: Callable) -> Callable:  # replayed with gemms_only (_replay_op)
        def run(self, *args):
            calls[(f"fused_attention.{name}", tuple(_spec(a) for a in args), ())] += 1
            return call(self, *args)
        return run

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                calls[(ops[func], tuple(_spec(a) for a in args), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))] += 1
            return func(*args, **kwargs)

    with Record(), _native_lora_wrapped(counted), _nf4_matmul_wrapped(counted_nf4), _nf4_amx_wrapped(counted_amx), \
            _nf4_brgemm_wrapped(counted_brgemm), _fused_attention_wrapped(counted_attention):
        step()
    return calls


def _materialize(spec, dtype: torch.dtype | None = None):
    """A random tensor of a recorded layout (in `dtype` instead of the recorded one when given); a tuple of them."""
    if isinstance(spec, tuple) and spec and spec[0] == "tensors":
        return tuple(_materialize(a, dtype) for a in spec[1])
    if not (isinstance(spec, tuple) and spec and spec[0] == "tensor"):
        return spec
    _, shape, stride, recorded = spec
    storage = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return (torch.randn(storage) * 0.05).to(dtype or getattr(torch, recorded)).as_strided(shape, stride)


def _replay_op(op: str, dtype: torch.dtype | None):
    module, _, name = op.partition(".")
    if module in NATIVE_MODULES:  # looked up at each call: profile_groups names it for the profiler
        if dtype is not None and module == "native_lora_fp32":  # (bf16_cost: the same products in bf16, by aten)
            return _THIN_PRODUCTS[name]
        if dtype is not None:  # (recorded only in bf16 steps, never replayed in another dtype)
            raise ValueError(f"{op} runs in bf16 only")
        return lambda *args, **kwargs: getattr(NATIVE_MODULES[module].kernels(), name)(*args, **kwargs)
    if module == "nf4_amx":  # (bf16 only, on a CPU with AMX) its GEMM on weights in the tiles' layout
        return lambda *args: getattr(nf4_amx.kernels(), name)(*args)
    if module == "nf4_brgemm":  # (bf16 only, on a CPU with AMX) its brgemm calls, the unpacking left out
        return lambda *args, **kwargs: getattr(nf4_brgemm.kernels(), name)(*args, **kwargs, unpack=False)
    if module == "fused_attention":  # (bf16 on a CPU with bf16 units) a layer's attention, its softmax left out
        return lambda *args: getattr(fused_attention.kernels(), name)(*args, gemms_only=True)
    if op == "mkldnn_linear":  # (x, W, bias, "none", [], ""); in another dtype, as F.linear computes it
        return torch.ops.mkldnn._linear_pointwise.default if dtype is None else (lambda x, w, b, *_: F.linear(x, w, b))
    name, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _thin_forward(y, x, A, B, scale):
    y.addmm_(a := x.mm(A.t()), B.t(), alpha=scale)
    return a, True


def _thin_backward(g, x, a, B, scale, need_a=True, need_A=True, need_B=True):
    grad_a = g.mm(B).mul_(scale) if need_a or need_A else None
    return grad_a, grad_a.t().mm(x) if need_A else None, g.t().mm(a).mul_(scale) if need_B else None


# native_lora_fp32's calls as aten's products, for timing them in bf16 where the bf16 kernels do not run
_THIN_PRODUCTS = {"forward_": _thin_forward, "backward": _thin_backward,
                  "input_update_": lambda grad_x, grad_a, A: grad_x.addmm_(grad_a, A)}


def _fresh(op: str, kwargs: tuple) -> tuple[str, tuple]:
    """The same product returning a new tensor: an .out call without its out (whose size a row slice changes)."""
    return op.removesuffix(".out"), tuple((k, v) for k, v in kwargs if k != "out")


def product_flops(op: str, args: tuple) -> int:
    """Multiply-adds × 2 of one recorded product, from its argument layouts."""
    shapes = [a[1] for a in args if isinstance(a, tuple) and a and a[0] == "tensor"]
    if op == "mkldnn_linear":  # x (..., in), W (out, in)
        x, w = shapes[0], shapes[1]
        return 2 * w[0] * w[1] * (math.prod(x) // x[-1])
    if op == "nf4_amx.gemm":  # a (M, K), B's tiles, its columns n
        return 2 * math.prod(shapes[0]) * args[2]
    if op == "nf4_brgemm.product":  # a (M, K), the codes, the scales, the block, W's (out, in), bias, transposed
        out_features, in_features = args[4]
        return 2 * math.prod(shapes[0]) * (out_features if len(args) < 7 or args[6] else in_features)
    a, b = shapes[-2], shapes[-1]  # (addmm, baddbmm: the input comes first)
    return 2 * math.prod(a) * b[-1]


SLICE_GFLOP = 1.0  # on a CPU without bf16 units each product is timed in bf16 on about this many GFLOP of it


def _rows(spec: tuple, m: int) -> tuple:
    """A tensor spec cut to its first m rows (dim 0), the strides as they were: a transposed operand stays one."""
    _, shape, stride, dtype = spec
    return ("tensor", (m, *shape[1:]), stride, dtype)


def row_slice(op: str, args: tuple, gflop: float = SLICE_GFLOP) -> tuple[tuple, float]:
    """(args of the same product cut along its first dimension to about `gflop` GFLOP, the fraction kept): rows of
    the left operand (and of a 2-D addmm input), or leading batches of a bmm (of both operands and its input)."""
    shapes = [a for a in args if isinstance(a, tuple) and a and a[0] == "tensor"]
    if op == "mkldnn_linear":  # x (..., in) as a contiguous (rows, in): the product reads it row-major either way
        x = shapes[0]
        rows, k = math.prod(x[1]) // x[1][-1], x[1][-1]
        args = (("tensor", (rows, k), (k, 1), x[3]), *args[1:])
        lead = 0
    else:
        tensors = [i for i, a in enumerate(args) if isinstance(a, tuple) and a and a[0] == "tensor"]
        lead = tensors[-2]  # the left operand (addmm, baddbmm: after their input)
        rows = args[lead][1][0]
    m = max(1, min(rows, math.ceil(rows * gflop * 1e9 / max(1, product_flops(op, args)))))
    batched = op.removesuffix(".out") in ("bmm", "baddbmm")
    cut = []
    for i, a in enumerate(args):
        is_tensor = isinstance(a, tuple) and a and a[0] == "tensor"
        if is_tensor and (i == lead or (batched and a[1][0] == rows) or (i < lead and len(a[1]) >= 2 and a[1][0] == rows)):
            a = _rows(a, m)
        cut.append(a)
    return tuple(cut), m / rows


def _time_once(op: str, args: tuple, kwargs: tuple, dtype: torch.dtype | None) -> float:
    fn = _replay_op(op, dtype)
    inputs, named = [_materialize(a, dtype) for a in args], {k: _materialize(v, dtype) for k, v in kwargs}
    fn(*inputs, **named)  # one untimed call first
    t0 = time.perf_counter()
    fn(*inputs, **named)
    return time.perf_counter() - t0


def bf16_cost(calls: Counter) -> dict:
    """What bf16 products cost on this CPU against fp32, without replaying the step in bf16 (many minutes where it
    is slow): each distinct product of the step timed once whole in its recorded fp32, and once in bf16 cut along
    its first dimension to about SLICE_GFLOP GFLOP (the operands' layouts kept), after an untimed call each; the
    bf16 slice's time scaled back to the whole product, each weighted by how often the step calls it. The adapters'
    thin products in C (native_lora_fp32's calls, a few MFLOP each) are timed whole, in bf16 as aten's products.

    fp32 is timed whole because a thin slice of it is bound by reading the weight, not by its arithmetic: at the
    1B shape's head (512 x 128,256 x 2,048) the input gradient took 51 ms a row on 2 rows and 5.6 on 32, so
    slicing it too made fp32 look ~10x slower. The bf16 fallback is bound by its arithmetic: 3.2-3.3 s a row
    on 2, 8 and 32 rows of the same product (ad hoc, the AMD EPYC of benchmarks/results/amd-epyc_avx2.md)."""
    fp32 = bf16 = 0.0
    for (op, args, kwargs), n in calls.items():
        # (native_lora_fp32's thin products, a few MFLOP each, timed whole in bf16 by aten)
        cut, kept = (args, 1.0) if op.partition(".")[0] in NATIVE_MODULES else row_slice(op, args)
        fp32 += n * _time_once(op, args, kwargs, None)
        fresh, fresh_kwargs = _fresh(op, kwargs)
        bf16 += n * _time_once(fresh, cut, fresh_kwargs, torch.bfloat16) / kept
    return {"fp32_s": fp32, "bf16_s": bf16, "calls": sum(calls.values()), "distinct": len(calls)}


def products_fn(calls: Counter, dtype: torch.dtype | None = None) -> Callable[[], None]:
    """A function that runs every recorded product (each as often as the step did) on random inputs of its layout,
    in `dtype` instead of the recorded dtypes when given."""
    prepared = [(_replay_op(op, dtype), [_materialize(a, dtype) for a in args],
                 {k: _materialize(v, dtype) for k, v in kwargs}, count)
                for (op, args, kwargs), count in calls.items()]

    def run() -> None:
        for fn, args, kwargs, count in prepared:
            for _ in range(count):
                fn(*args, **kwargs)

    return run


PROFILE_GROUPS = {  # profiler op name -> group, for "what the rest of the step is"
    "aten::mm": "matrix products", "aten::addmm": "matrix products", "aten::addmm_": "matrix products",
    "aten::bmm": "matrix products", "aten::baddbmm": "matrix products",
    "mkldnn::_linear_pointwise": "matrix products",  # the fp32 rows' frozen products (minikernels.fp32_gemm)
    **{f"minituner::{module}.{name}": "matrix products" for module in NATIVE_MODULES for name in NATIVE_LORA},
    **{f"miniquant::nf4_matmul.{name}": "matrix products" for name in NF4_PRODUCTS},  # (the NF4 unpacked inside)
    "miniquant::nf4_amx.gemm": "matrix products", "miniquant::nf4_amx.pack": "NF4 dequantization",
    "miniquant::nf4_brgemm.product": "matrix products",  # (its NF4 unpacking inside, as nf4_matmul's)
    # minigpt.fused_attention: one C call each way, its products inside (in the floor, the same calls without softmax)
    "minigpt::fused_attention.forward": "attention kernel", "minigpt::fused_attention.backward": "attention kernel",
    "_FusedCausalAttention": "attention kernel", "_FusedCausalAttentionBackward": "attention kernel",
    # (profile_groups names them)
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention kernel",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention kernel",
    # minigpt.native_attention: its GEMMs are aten::bmm (matrix products); its own time is the C softmax kernels
    "_CausalAttention": "attention kernel", "_CausalAttentionBackward": "attention kernel",
    "aten::copy_": "dtype casts and copies",
    # the Functions around each base product (minituner.lora_product's, with its adapter; miniquant's, alone): their
    # own time is the C dequantization into the workspace of an NF4 base, and their Python
    "DequantLinearFunction": "NF4 dequantization", "DequantLinearFunctionBackward": "NF4 dequantization",
    "LoRAProduct": "NF4 dequantization", "LoRAProductBackward": "NF4 dequantization",
    # the norms with their bf16 hand-out (RMSNorm, LayerNorm, and a block's norm after its residual add, minigpt.
    # residual's add_and_norm: one pass of C), SwiGLU's gate, GELU and RoPE in C (minigpt.native_norm, native_swiglu,
    # native_gelu, native_rope)
    "_RMSNormBf16": "C norms and activations", "_RMSNormBf16Backward": "C norms and activations",
    "_LayerNormBf16": "C norms and activations", "_LayerNormBf16Backward": "C norms and activations",
    "_AddNormBf16": "C norms and activations", "_AddNormBf16Backward": "C norms and activations",
    "_SwiGLU": "C norms and activations", "_SwiGLUBackward": "C norms and activations",
    "_RopeQK": "C norms and activations", "_RopeQKBackward": "C norms and activations",
    "_GeluTanh": "C norms and activations", "_GeluTanhBackward": "C norms and activations",
    "_GeluExactBackward": "C norms and activations",  # (its forward is PyTorch's aten::gelu: 'other')
}


def profile_groups(step: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """(wall seconds of one profiled step, self CPU seconds by group); everything unlisted is 'other'."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def named(name: str, call: Callable) -> Callable:  # C calls the profiler does not see on its own
        def run(self, *args, **kwargs):
            with record_function(f"minituner::{_native_module(self)}.{name}"):
                return call(self, *args, **kwargs)
        return run

    def named_in(module: str, package: str = "miniquant") -> Callable[[str, Callable], Callable]:  # by module
        def named_call(name: str, call: Callable) -> Callable:
            def run(self, *args, **kwargs):
                with record_function(f"{package}::{module}.{name}"):
                    return call(self, *args, **kwargs)
            return run
        return named_call

    with profile(activities=[ProfilerActivity.CPU]) as prof, _native_lora_wrapped(named), \
            _nf4_matmul_wrapped(named_in("nf4_matmul")), _nf4_amx_wrapped(named_in("nf4_amx")), \
            _nf4_brgemm_wrapped(named_in("nf4_brgemm")), \
            _fused_attention_wrapped(named_in("fused_attention", "minigpt")):
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    groups: Counter = Counter()
    for e in prof.key_averages():
        groups[PROFILE_GROUPS.get(e.key, "other")] += e.self_cpu_time_total / 1e6
    return wall, dict(groups)


@contextmanager
def _sdpa_attention(on: bool):
    """With on: the models attend through F.scaled_dot_product_attention, as transformers' models do on CPU
    (minigpt.native_attention's kernels reported absent for the while)."""
    if not on:
        yield
        return
    with mock.patch.object(native_attention, "kernels", lambda: None):
        yield


def _batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every row trains on: token ids and targets (B, T), seeded."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    return x, y


def make_step(shape: Shape, config: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    """One configuration's optimizer step on (x, y), returning its loss; ``step.forward_backward`` is the step
    without the update (for recording its products)."""
    model = build(shape, config)
    model.train()
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=LR)
    autocast = config in (*PEFT_BF16, *OUR_ATTENTION)
    sdpa = config.startswith("peft_bnb") and config not in OUR_ATTENTION

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if config.startswith("peft_bnb"):  # transformers' loss: the logits upcast to fp32, then cross-entropy
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _sdpa_attention(sdpa):
                logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        else:  # ours as finetune runs it: minigpt.cross_entropy reads the logits in the head's dtype
            loss = lm_loss(model, x, y)
        with _sdpa_attention(sdpa):  # the backward of the attention the forward ran
            loss.backward()
        return loss

    def step() -> float:
        loss = forward_backward().item()
        opt.step()
        return loss

    step.forward_backward = forward_backward
    return step


def _our_attention() -> str:  # a phrase of the section's text, chosen by the CPU
    if fused_attention.usable():
        units = "on AMX's tiles" if fused_attention.kernels().tiles else "as AVX512-BF16's dot products (vdpbf16ps)"
        return (f"{units} in blocks of 32 or 64 queries, each block's scores kept in the thread's cache, the "
                "softmax and its gradient in fp32 in C, `minigpt.fused_attention`")
    return "q·kᵀ and P·v as bf16 GEMMs, the softmax and its gradient in fp32 in C, `minigpt.native_attention`"


def _attention_in_floor() -> str:
    if fused_attention.usable():
        return ("minigpt.fused_attention's forward and backward, one C call each, counted as the same calls with the "
                "softmax and its gradient left out: their products and the packing of their operands")
    return "q·kᵀ, P·v and their gradients' GEMMs, aten::bmm"


def _attention_outside_products() -> str:
    if fused_attention.usable():
        return "(minigpt.fused_attention's two C calls, their products included: the floor counts those apart)"
    return "outside its GEMMs (minigpt.native_attention's C softmax and softmax gradient)"


def rows(bf16: bool) -> list[str]:
    """The rows a CPU runs: every configuration where it has bf16 units; else the fp32 ones (see measure_row)."""
    return list(CONFIGS) if bf16 else list(FP32_CONFIGS)


def measure_row(shape_name: str, row: str, warmup: int) -> dict:
    """One row in this process of its own: build it (the floor: record one QLoRA step's products, drop that model,
    prepare the replay), warm up, take the steps the parent asks for (paced.serve), then profile one more."""
    import bitsandbytes  # noqa: F401  the same imports in every row: equal baselines
    import peft  # noqa: F401

    from paced import serve

    shape = SHAPES[shape_name]
    if row.endswith(FIXED_SUFFIX):  # a FIXED_ROWS configuration on the shape's small variant
        shape, row = SMALL_SHAPES[shape_name](), row.removesuffix(FIXED_SUFFIX)
    x, y = _batch(shape)
    # without bf16 units a bf16 step takes many times an fp32 one: only the fp32 rows run, their products form the
    # floor, and bf16_cost times them in bf16 against fp32, to show what bf16 costs here
    bf16 = bf16_support("cpu").fast
    facts: dict = {}
    if row == "floor":
        floor_of = "qlora_bf16" if bf16 else "qlora_fp32"
        calls = record_products(make_step(shape, floor_of, x, y).forward_backward)  # AdamW holds no products
        gc.collect()  # the model recorded is gone, and the heap hands back what it held: this process holds the
        trim_now()  # replay's operands only
        replay = products_fn(calls)

        def step() -> None:
            replay()

        facts = {"floor_of": floor_of, "products": sum(calls.values()),
                 "native_lora": native_lora.kernels() is not None,  # the adapters' thin products in C (not aten's)
                 "product_dtypes": sorted({a[3] for (op, args, _), _ in calls.items()  # (nf4_brgemm: a's,
                                           for a in (args[:1] if op.startswith("nf4_brgemm.") else args)  # not W's)
                                           if isinstance(a, tuple) and a and a[0] == "tensor"})}
    else:
        step = make_step(shape, row, x, y)
    t0 = time.perf_counter()
    losses = [step()]
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        losses.append(step())
    reset_peak_rss()
    times, _, served = serve(step)
    peak = peak_rss_mib()  # over the timed steps (before the profiled one and its records)
    losses = [v for v in losses + served if v is not None]
    if row == "floor" and not bf16:
        facts["bf16_cost"] = bf16_cost(calls)
    return {"times": times, "first_s": first_s, "losses": losses[:1] + losses[-1:], "groups": profile_groups(step)[1],
            "threads": torch.get_num_threads(), "peak_rss_mib": peak, **facts}


# ---- the section (runs in the parent) ------------------------------------------------------------


def row_groups(bf16: bool) -> list[list[str]]:
    """The rows timed together, group after group: where the CPU has bf16 units, first the goals' rows (ours LoRA
    and QLoRA bf16, PEFT + bitsandbytes' two bf16 settings, the floor, the fixed-cost rows), then the rest (the
    fp32 rows, the informational one); else one group. Fewer processes alive at once: with every row of the
    llama-1b shape alive together (about 19 GiB resident on a 23 GiB machine), PEFT + bitsandbytes' bf16 step
    (the model in bf16) took 4.27 s against 2.81-3.09 s with five rows or fewer alive, ours 2.62 s against
    1.89-2.22 s: ours over theirs 0.58x against 0.67-0.68x (AMD EPYC with AVX512-BF16, 2 cores, 2026-12-07; medians
    of 5-8 turns), a bias in our favour."""
    if not bf16:
        return [[*rows(False), "floor"]]
    goals = ["lora_bf16", "qlora_bf16", *PEFT_BF16, "floor", *(r + FIXED_SUFFIX for r in FIXED_ROWS)]
    return [goals, [r for r in rows(True) if r not in goals]]


def _run(shape: str, warmup: int, repeats: int) -> dict:
    """Every row of the shape in a subprocess of its own, each group of row_groups alive together and their timed
    steps alternating (paced.run_paced), one group after the other; the rows' results gathered."""
    bf16 = bf16_support("cpu").fast
    configs = rows(bf16)
    t0 = time.perf_counter()
    results, groups = {}, row_groups(bf16)
    for group in groups:
        children = {r: ([sys.executable, str(Path(__file__).resolve()), "--shape", shape, "--row", r, "--warmup",
                         str(warmup)], None) for r in group}
        results.update(run_paced(children, turns=repeats, warm=SETTLE_STEPS, timeout_s=3600))
    wall = time.perf_counter() - t0
    failed = {r: v["error"] for r, v in results.items() if "error" in v}
    if failed:
        raise RuntimeError(f"bf16 {shape} failed: {failed}")
    floor = results["floor"]
    return {"timings": {r: [statistics.median(v["times"]), min(v["times"]), v["first_s"]] for r, v in results.items()},
            "times": {r: v["times"] for r, v in results.items()},  # in turn order: turn i's timed step of each row
            "rounds": repeats, "configs": configs, "row_groups": groups, "floor_of": floor["floor_of"],
            "bf16_cost": floor.get("bf16_cost"),
            "losses": {r: v["losses"] for r, v in results.items() if r != "floor"},
            "groups": {r: v["groups"] for r, v in results.items()}, "threads": floor["threads"],
            "peak_rss_mib": {r: v["peak_rss_mib"] for r, v in results.items()}, "products": floor["products"],
            "native_lora": floor["native_lora"], "product_dtypes": floor["product_dtypes"], "wall_s": wall}


GROUPS = ("matrix products", "attention kernel", "NF4 dequantization", "C norms and activations", "dtype casts and copies",
          "other")


def run(quick: bool = False, wait_s: float | None = None) -> list[Section]:
    """One section per shape of the bench (QUICK_SHAPES in a quick run)."""
    return [run_shape(shape, quick, wait_s) for shape in (QUICK_SHAPES if quick else BENCH_SHAPES)]


def run_shape(shape: str, quick: bool = False, wait_s: float | None = None) -> Section:
    spec, support = SHAPES[shape], bf16_support("cpu")
    warmup, repeats = (1, 2) if quick else (2, spec.turns)
    wait_s = (0.0 if quick else WAIT_PER_CONFIG_S) if wait_s is None else wait_s
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    busy, _ = wait_for_quiet(wait_s, log=log)
    small = f", {len(FIXED_ROWS)} of them made small" if support.fast else ""
    log(f"[bench]   bf16 {shape}: {len(CONFIGS if support.fast else FP32_CONFIGS)} configurations and the floor{small}, "
        f"each in a process of its own (machine busy {busy:.0f}%)")
    res = _run(shape, warmup, repeats)
    if res["floor_of"] != "qlora_bf16":  # a CPU without bf16 units: the fp32 rows only
        return fp32_only_section(shape, res, support, busy, warmup)
    t = {c: v[0] for c, v in res["timings"].items()}  # medians
    floor = t["floor"]
    section = Section(
        f"bf16 training step, {shape} shape",
        f"{spec.describe}; LoRA r = {spec.rank}, alpha {spec.alpha:g} on {', '.join(spec.targets)}; {OPTIMIZER_NOTE}; loss in "
        f"fp32. Ours in bf16: `use_bf16_compute` (frozen base stored in bf16, NF4 dequantized to bf16 into a reused "
        "workspace, LoRA factors fp32 masters computed in bf16, base and adapter one autograd Function "
        "(`minituner.lora_product`), the block bf16 from each norm (in C, `minigpt.native_norm`) to the residual add "
        f"(attention: {_our_attention()}), the residual stream and "
        "norms in fp32, bf16 logits (of 32 MiB or more: written into huge pages, the last step's again once "
        "spent, `minikernels.large_output`) "
        "whose loss `minigpt.cross_entropy` computes in fp32 a few rows at a time; "
        "glibc keeps what a step frees and the forward trims the heap where much lies free in it, "
        "`minituner.memory.heap`, both set when ours are built). "
        "PEFT + bitsandbytes in bf16: Linear4bit(compute_dtype=bf16) with the forward under torch.autocast('cpu', "
        "bf16), the rest of the model in fp32 or, as `from_pretrained(dtype=bfloat16)` loads it, in bf16 (NF4 "
        "quantized from the bf16 weights); its logits upcast to fp32 for the loss, as transformers' "
        "ForCausalLMLoss does; it runs our model code with Linear4bit swapped in, attending through SDPA's fused "
        "kernel as transformers' models do on CPU (an informational row gives it our attention instead); the goal "
        "compares ours with the faster of its two settings. "
        f"{_paced_note(res, warmup)} The floor: every matrix product of one QLoRA bf16 step ({res['products']} calls; dtypes "
        f"{', '.join(res['product_dtypes'])}; attention's among them ({_attention_in_floor()}), and the adapters' thin "
        "products, which "
        "minituner.native_lora runs in C where the CPU has AVX512-BF16 (x·Aᵀ and g·B on AMX's tiles where it has "
        "them); " + ("an NF4 weight's input gradient, which miniquant.nf4_matmul runs in C there with the codes "
                     "unpacked inside and the adapter's share of that gradient added in the same sums, counts as the "
                     "product PyTorch would run from the weight in bf16, aten::mm, and that share as native_lora's "
                     "call" if nf4_matmul.chosen() else
                     "an NF4 weight's input gradient is aten::mm on the weight dequantized into the workspace: on a "
                     "CPU with AMX oneDNN's GEMM is faster than miniquant.nf4_matmul, which is not chosen") +
        ("; the products of NF4 weights of at most 2^20 values run on AMX's tiles as miniquant.nf4_amx's own GEMM "
         "(the adapter's share added inside it), and count as that GEMM, the weight's writing into the tiles' layout "
         "left out as dequantization is"
         if nf4_amx.usable() else "") +
        ("; the products of larger NF4 weights (inputs of at most 512 rows) run as miniquant.nf4_brgemm, the weight "
         "unpacked panel by panel into a thread's buffer and multiplied at once by oneDNN's brgemm micro-kernel "
         "(the adapter's share added inside, one more brgemm call), and count as those brgemm calls alone "
         "(unpack=False), "
         "the unpacking left out as dequantization is"
         if nf4_brgemm.usable() else "") +
        "), recorded with a TorchDispatchMode (the C calls by "
        "wrapping them) and replayed back to back on random "
        "inputs of the same shapes and strides. 'profiled share': self CPU time by group in one profiled step "
        f"(profiler overhead included). CPU bf16 units: {support.reason}. Machine CPU use before the run: {busy:.0f}%.",
        ["configuration", "median step", "fastest step", "vs ours QLoRA bf16",
         "matrix products / attention / NF4 dequantization / C norms and activations / casts / other (profiled share)",
         "loss step 0 → last"],
    )
    for config, label in CONFIGS.items():
        shares = _shares(res["groups"][config])
        first, last = res["losses"][config]
        section.rows.append([label, fmt_seconds(t[config]), fmt_seconds(res["timings"][config][1]),
                             fmt_ratio(t[config] / t["qlora_bf16"]), shares, f"{first:.4f} → {last:.4f}"])
    section.rows.append(["floor: the matrix products of ours QLoRA bf16, replayed alone", fmt_seconds(floor),
                         fmt_seconds(res["timings"]["floor"][1]), fmt_ratio(floor / t["qlora_bf16"]),
                         " / ".join(["100%"] + ["–"] * (len(GROUPS) - 1)),
                         ""])
    peft_best = min(PEFT_BF16, key=lambda c: t[c])
    fixed = {r: t[r + FIXED_SUFFIX] for r in FIXED_ROWS}  # the small variants' medians
    q = res["groups"]["qlora_bf16"]
    rest = t["qlora_bf16"] - floor
    products_in_step = q.get("matrix products", 0.0)
    products_replayed = res["groups"].get("floor", {}).get("matrix products", 0.0)
    not_here = "" if support.fast else "not measurable here: this CPU has no bf16 units. "
    times = res["times"]

    def turns(row: str, other: str) -> str:  # the goal's ratio turn by turn (timing.per_turn_ratio)
        return f"turn by turn, the two timed in the same turn: {per_turn_ratio(times[row], times[other])}; "

    section.goals += [
        Goal(f"bf16 step ({shape}): ours QLoRA / PEFT + bitsandbytes (autocast, its faster setting)",
             t["qlora_bf16"] / t[peft_best], VS_PEFT_BNB_GOAL, False,
             f"{not_here}{turns('qlora_bf16', peft_best)}"
             "our step's own matrix products, replayed alone (the floor), take "
             f"{fmt_ratio(floor / t[peft_best])} PEFT + bitsandbytes' step: "
             + ("no step that runs them reaches the goal on this CPU. " if floor / t[peft_best] > VS_PEFT_BNB_GOAL
                else f"the goal leaves {fmt_seconds(VS_PEFT_BNB_GOAL * t[peft_best] - floor)} a step for all else. ")
             + f"PEFT + bitsandbytes' faster bf16 setting here: {PEFT_SETTING[peft_best]} "
             f"({fmt_seconds(t[peft_best])}; the other {fmt_seconds(max(t[c] for c in PEFT_BF16))}). Under autocast it "
             "dequantizes to bf16 and casts activations per call; both run the same bf16 products; its attention is "
             "SDPA's fused kernel on bf16 (autocast lists SDPA), as in transformers' models, ours "
             f"{_our_attention()} (given to PEFT + bitsandbytes' model in bf16: "
             f"{fmt_seconds(t[OUR_ATTENTION[0]])}, {fmt_ratio(t['qlora_bf16'] / t[OUR_ATTENTION[0]])} for ours "
             f"against that); fp32 beside: ours QLoRA {fmt_seconds(t['qlora_fp32'])}, PEFT + bitsandbytes "
             f"{fmt_seconds(t['peft_bnb_fp32'])}",
             measurable=support.fast),
        Goal(f"bf16 step ({shape}): ours QLoRA / its matrix products alone", t["qlora_bf16"] / floor, VS_FLOOR_GOAL,
             False,
             f"{not_here}{turns('qlora_bf16', 'floor')}"
             f"the rest, {fmt_seconds(rest)} a step: {fmt_seconds(fixed['qlora_bf16'])} of it the fixed cost "
             f"of any step of these layers (the same configuration at a small width and {SMALL_TOKENS} tokens, see "
             "the notes: Python, dispatch and autograd around each op); the step's products themselves take "
             f"{'longer than' if products_in_step > products_replayed else 'no longer than'} replayed "
             f"({fmt_seconds(products_in_step)} in one profiled step against {fmt_seconds(products_replayed)} for "
             "the replay profiled the same way, which reruns each product on the same operands back to back, so "
             "operands that fit in cache stay there), and outside the products, in that profiled step, attention "
             f"{_attention_outside_products()} took "
             f"{fmt_seconds(q.get('attention kernel', 0.0))}, NF4 dequantization (C, into the workspace, or into "
             f"AMX's tile layout for miniquant.nf4_amx's GEMM, once per weight for the forward, twice where the input "
             f"gradient does not run in miniquant.nf4_matmul, with the Python of the Function around each product"
             + ("; miniquant.nf4_brgemm's unpacking is inside its calls, among the products" if nf4_brgemm.usable()
                else "") + ") "
             f"{fmt_seconds(q.get('NF4 dequantization', 0.0))}, "
             + (f"the C norm, activation and RoPE kernels {fmt_seconds(q['C norms and activations'])}, "
                if q.get("C norms and activations") else "")
             + "dtype casts and copies (aten's copy_: "
             + ("" if fused_attention.usable() else "attention's heads grouped for its GEMMs and back, ")
             + "the residual adds' bf16 gradients"
             + ("" if res.get("native_lora") else ", the LoRA masters' bf16 copies") + ") "
             f"{fmt_seconds(q.get('dtype casts and copies', 0.0))}, everything else (PyTorch's exact GELU forward, "
             f"{'' if native_rope.kernels() is not None else 'RoPE, '}the residual adds, the loss, embeddings, AdamW, "
             f"the finite-output guards, autograd) "
             f"{fmt_seconds(q.get('other', 0.0))}",
             measurable=support.fast),
        Goal(f"bf16 step ({shape}): ours QLoRA / ours LoRA", t["qlora_bf16"] / t["lora_bf16"], VS_LORA_GOAL, False,
             f"{not_here}{turns('qlora_bf16', 'lora_bf16')}"
             "an NF4 dequantization of every base weight per step for the forward, into one reused bf16 "
             "workspace, and " + ("its codes unpacked again inside the input gradient's product (miniquant.nf4_matmul; "
                                  "where that does not run, a second dequantization into the workspace)"
                                  if nf4_matmul.chosen() else
                                  "a second one for the input gradient (on a CPU with AMX oneDNN's GEMM on the "
                                  "dequantized weight is faster than miniquant.nf4_matmul)") +
             (" (weights of at most 2^20 values written into AMX's tile layout instead, for miniquant.nf4_amx's "
              "GEMM)" if nf4_amx.usable() else "") +
             (" (larger ones unpacked panel by panel inside miniquant.nf4_brgemm's product instead, for oneDNN's "
              "brgemm)" if nf4_brgemm.usable() else "") +
             ", and the finite-output guards QLoRA adds (build_for_training)",
             measurable=support.fast),
    ]
    small = SMALL_SHAPES[shape]()
    section.notes += [
        f"The fixed cost of a step: ours QLoRA bf16 and PEFT + bitsandbytes ({PEFT_SETTING[FIXED_ROWS[1]]}) on the "
        f"shape made small ({small.describe}; the same layers, targets and rank: the same ops, every NF4 weight "
        "dequantized by the C kernel as at full size, next to no arithmetic), timed in the same turns, each in a process "
        f"of its own: ours {fmt_seconds(fixed['qlora_bf16'])}, PEFT + bitsandbytes {fmt_seconds(fixed[FIXED_ROWS[1]])} "
        "a step. That is what a step of these layers pays whatever its width: Python, PyTorch's dispatch and "
        "autograd around each op, and each kernel's call (a large call also hands work to a second thread, which "
        f"these small ones do not: a lower bound). Ours: {100 * fixed['qlora_bf16'] / rest:.0f}% of its rest over "
        f"the floor ({fmt_seconds(rest)}).",
        f"bf16 over fp32, same run: ours LoRA {fmt_ratio(t['lora_fp32'] / t['lora_bf16'])} faster, ours QLoRA "
        f"{fmt_ratio(t['qlora_fp32'] / t['qlora_bf16'])}, PEFT + bitsandbytes "
        f"{fmt_ratio(t['peft_bnb_fp32'] / t[peft_best])} (its faster bf16 setting)",
    ]
    return _closing_notes(section, res, spec)


def _paced_note(res: dict, warmup: int) -> str:
    """_PACED_NOTE for this run: its turns, warm-up steps and the groups its rows ran in (row_groups)."""
    groups = res["row_groups"]
    together = "all alive together" if len(groups) == 1 else (
        f"in groups timed one after the other ({', then '.join(', '.join(g) for g in groups)}), the rows of a group "
        "alive together: fewer processes alive at once, as every row alive together slowed PEFT + bitsandbytes' "
        "step more than ours (row_groups in benchmarks/bench_bf16.py gives the figures)")
    return _PACED_NOTE.format(turns=res["rounds"], warmup=warmup, together=together)


_PACED_NOTE = (
    "Every row, the floor too, runs in a subprocess of its own, as a training run has its "
    "process to itself (its heap; ours with build_for_training's allocator settings, PEFT's with glibc's "
    "defaults), {together}; each built and warmed up ({warmup} step(s)) in turn, then timed in {turns} turns, "
    "each giving "
    f"every row {SETTLE_STEPS} untimed step(s) and then one timed step, who goes first rotating and the rest "
    "shuffled (paced.run_paced), so load from other processes falls on all rows alike. Each goal is a ratio of "
    "two medians; beside it, the same ratio turn by turn (timing.per_turn_ratio): a slow phase of the machine "
    "that spans turns moves the medians, not the ratio within a turn.")


def _closing_notes(section: Section, res: dict, spec: Shape) -> Section:
    peaks = res["peak_rss_mib"]
    largest = max(peaks, key=peaks.get)
    section.notes.append(f"torch threads: {res['threads']}; the section's subprocesses took {fmt_seconds(res['wall_s'])} "
                         f"from the first start to the last result; peak RSS over the timed steps, by process: "
                         + ", ".join(f"{r} {v / 1024:.1f} GiB" for r, v in peaks.items())
                         + f" (the largest: {largest}; the groups' sums: "
                         + ", ".join(f"{sum(peaks.get(r, 0) for r in g) / 1024:.1f} GiB"
                                     for g in res["row_groups"]) + ")")
    if spec.note:
        section.notes.append(spec.note)
    return section


def _shares(groups: dict[str, float]) -> str:
    total = sum(groups.values())
    return " / ".join(f"{100 * groups.get(g, 0.0) / total:.0f}%" for g in GROUPS)


def fp32_only_section(shape: str, res: dict, support, busy: float, warmup: int) -> Section:
    """The section on a CPU without bf16 units: the fp32 rows and their floor, what bf16 products cost here, and
    the bf16 goals marked not measurable."""
    spec = SHAPES[shape]
    t = {c: v[0] for c, v in res["timings"].items()}  # medians
    floor, cost = t["floor"], res["bf16_cost"]
    slower = cost["bf16_s"] / cost["fp32_s"]
    timed = (f"the step's {cost['calls']} products ({cost['distinct']} distinct), each timed once whole in fp32 and "
             f"once in bf16 on a slice of its rows of about {SLICE_GFLOP:g} GFLOP scaled to the whole: "
             f"{fmt_seconds(cost['bf16_s'])} in bf16 against {fmt_seconds(cost['fp32_s'])} in fp32, {fmt_ratio(slower)}")
    section = Section(
        f"bf16 training step, {shape} shape",
        f"{spec.describe}; LoRA r = {spec.rank}, alpha {spec.alpha:g} on {', '.join(spec.targets)}; {OPTIMIZER_NOTE}; loss in "
        f"fp32. CPU bf16 units: {support.reason}. On such a CPU PyTorch multiplies bf16 through a fallback "
        f"that runs slower than its fp32 products ({timed}), so `finetune` refuses bf16 here and "
        "this section runs only the fp32 rows: ours LoRA and QLoRA (`precision=\"fp32\"`) and PEFT + "
        "bitsandbytes QLoRA with compute_dtype fp32 (our model code with Linear4bit swapped in, attending "
        f"through SDPA). {_paced_note(res, warmup)} The floor: every matrix "
        f"product of one QLoRA fp32 step ({res['products']} calls; dtypes {', '.join(res['product_dtypes'])}; "
        "the frozen products through oneDNN's linear where minikernels.fp32_gemm chose it), recorded with a "
        "TorchDispatchMode and replayed back to back on random inputs of the same shapes and strides. 'profiled "
        f"share': self CPU time by group in one profiled step. Machine CPU use before the run: {busy:.0f}%.",
        ["configuration", "median step", "fastest step", "vs ours QLoRA fp32",
         "matrix products / attention / NF4 dequantization / C norms and activations / casts / other (profiled share)",
         "loss step 0 → last"],
    )
    for config in res["configs"]:
        first, last = res["losses"][config]
        section.rows.append([CONFIGS[config], fmt_seconds(t[config]), fmt_seconds(res["timings"][config][1]),
                             fmt_ratio(t[config] / t["qlora_fp32"]), _shares(res["groups"][config]),
                             f"{first:.4f} → {last:.4f}"])
    section.rows.append(["floor: the matrix products of ours QLoRA fp32, replayed alone", fmt_seconds(floor),
                         fmt_seconds(res["timings"]["floor"][1]), fmt_ratio(floor / t["qlora_fp32"]),
                         " / ".join(["100%"] + ["–"] * (len(GROUPS) - 1)), ""])
    why = (f"not measurable here: {support.reason}, where the step's bf16 products take "
           f"{fmt_ratio(slower)} their fp32 time (estimated as the intro says), so no bf16 row ran. fp32 beside: ours QLoRA {fmt_seconds(t['qlora_fp32'])}, ours LoRA {fmt_seconds(t['lora_fp32'])}, PEFT + "
           f"bitsandbytes {fmt_seconds(t['peft_bnb_fp32'])}")
    section.goals += [
        Goal(f"bf16 step ({shape}): ours QLoRA / PEFT + bitsandbytes (autocast, its faster setting)", None,
             VS_PEFT_BNB_GOAL, False, why, measurable=False),
        Goal(f"bf16 step ({shape}): ours QLoRA / its matrix products alone", None, VS_FLOOR_GOAL, False, why,
             measurable=False),
        Goal(f"bf16 step ({shape}): ours QLoRA / ours LoRA", None, VS_LORA_GOAL, False, why, measurable=False),
    ]
    section.notes += [
        f"fp32, same run: ours QLoRA / PEFT + bitsandbytes {fmt_ratio(t['qlora_fp32'] / t['peft_bnb_fp32'])}, ours "
        f"QLoRA / ours LoRA {fmt_ratio(t['qlora_fp32'] / t['lora_fp32'])}, ours QLoRA / its products alone "
        f"{fmt_ratio(t['qlora_fp32'] / floor)}",
    ]
    return _closing_notes(section, res, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one row of a bf16 section (paced.serve), its result as JSON on the last line")
    parser.add_argument("--shape", default="gpt", choices=list(SHAPES))
    parser.add_argument("--row", required=True, choices=[*CONFIGS, "floor", *(r + FIXED_SUFFIX for r in FIXED_ROWS)])
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(measure_row(args.shape, args.row, max(1, args.warmup))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

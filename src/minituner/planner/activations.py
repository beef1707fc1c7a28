"""Exact activation memory of MiniGPT (and GPT-2 imported into it): the bytes its forward saves for backward.

Derived from what ``minigpt.model.MiniGPT`` + ``minigpt.train.lm_loss`` actually save, op by op, and
checked against ``torch.autograd.graph.saved_tensors_hooks`` by ``minituner memory-check`` (each
storage counted once, parameters and buffers excluded). Autograd records an op only when one of its
inputs requires grad, and then saves only what the gradients it must compute need, so what is saved
depends on the regime: in full fine-tuning everything is "hot" from the embeddings on; in LoRA the
frozen embeddings feed a stream that needs no grad until the first LoRA layer of block 0.

With N = batch·seq tokens, C = d_model, F = d_ff, h = n_head, V = vocab, r = LoRA rank, e = bytes per
activation element between a norm and the residual add (4 for an fp32 run, 2 under bf16 compute), s = bytes
per element of the residual stream and of what the norms save (``stream_bytes``: e unless given; 4 under bf16
compute, where the stream stays fp32 and the norms compute in it), c = bytes per element of the per-call
copies of the LoRA factors (``lora_copy_bytes``: 0 where LoRA computes with its parameters as they are, 2
under bf16 compute), the terms are:

- ``token/position ids``: the embedding lookups save their int64 indices, N·8 + seq·8, in full FT only
  (frozen embeddings record nothing).
- ``layernorm input`` N·C·s and ``layernorm mean/rstd`` 2·N·s, for ln_1, ln_2 (each block) and ln_f,
  whenever the norm's output needs grad (its input does, or its affine weights train). Under bf16 compute
  the norm reads the fp32 stream, and the forward hook that casts its output to bf16 saves nothing.
- ``linear input`` N·C·e (or N·F·e for fc2): a Linear whose weight trains (full FT) or that carries a
  LoRA A (A saves its input) keeps its input; q/k/v share one input (ln_1's output), counted once. A
  frozen Linear saves only its weight (a parameter, not an activation). o_proj's input is the attention
  output's storage, already counted when attention was recorded.
- ``LoRA A output`` N·r·e per LoRA layer: B saves A's output for its weight grad.
- ``LoRA factor copies`` r·(in + out)·c per LoRA layer: under bf16 compute each LoRALinear casts its fp32
  masters A and B to bf16 per call and ``LoRAUpdate`` saves those copies (not parameters: activations).
  Where c is 0 it saves the factors themselves, parameters, counted as weights; so does
  ``minituner.native_lora`` (``bf16_compute_lora``: bf16 compute on a CPU with AVX512-BF16, an even rank, no LoRA
  dropout), which reads the fp32 masters itself.
- ``attention q, k, v`` 3·N·C·e, ``attention output`` N·C·e and ``attention logsumexp`` h·N·4 (fp32):
  ``F.scaled_dot_product_attention`` without dropout runs the fused (flash) kernel, which keeps its
  inputs, its output and one logsumexp per query and head, never the h·seq² score matrix. Its output is
  laid out (B, T, h, hs), so ``transpose(1, 2).contiguous()`` is a view and o_proj saves no new storage.
  Under bf16 compute on a CPU where ``minigpt.native_attention`` runs (its kernels built, seq at most its
  ``MAX_TOKENS``), attention keeps q, k, v and the logsumexp but not its output: o_proj keeps that
  (``linear input`` N·C·e) when it trains. Where its probabilities take no more than q, k and v
  (``native_attention.keeps_probabilities``: h·T <= 3·C, short sequences) it keeps them instead of the logsumexp
  (``attention probabilities kept`` h·N·T·e).
- ``gelu input`` N·F·e: GELU keeps fc1's output; fc2 (or its LoRA A) keeps GELU's output (``linear input``).
- the loss (``lm_loss``: ``minigpt.cross_entropy``; the head returns its logits in the block's dtype e):
  fp32 logits go to ``F.cross_entropy``, which keeps the ``log-softmax output`` N·V·4; narrower logits, and fp32
  ones of at least ``fp32_loss_chunked``'s size, go to its chunked cross-entropy, which keeps the ``logits kept by
  the loss`` N·V·e and a ``loss logsumexp`` N·4 (``loss_saved``). Both keep the ``targets`` N·8 (int64) and an
  fp32 ``loss total_weight`` (4 bytes).
- with the model's dropout p > 0 (``dropout``: MiniGPT's ``GPTConfig.dropout``, GPT-2's 0.1 as finetune trains
  it; planned on a CPU, where ``F.dropout`` multiplies by a float noise tensor of its input's dtype and keeps it):
  ``dropout noise`` N·C·e after o_proj and after fc2 wherever their output needs grad, and N·C·s after the
  embeddings (full FT). Attention with dropout takes SDPA's math path, in fp32 whatever the block's dtype (it
  upcasts bf16 and fp16 on a CPU), which keeps no logsumexp and no output but the h·T² terms
  (``math_attention_saved``): the scaled q and k of q·kᵀ (each for the other's gradient), the ``attention
  probabilities`` and the ``attention dropout noise`` (B·h·T²·4 each) when q or k needs grad, v when they do, and
  the ``attention dropped probabilities`` (B·h·T²·4) when v does. Its output is laid out (B, h, T, hs), so
  o_proj's input is a copy it keeps (``linear input``) when it trains. ``minigpt.native_attention`` never runs
  with dropout.
- with LoRA dropout (``lora_dropout``: ``finetune --dropout``) each LoRA layer's A reads a dropped copy of the
  layer's input and keeps it, its own (``LoRA dropped input`` N·in·e), instead of the layer's shared input, and
  the dropout keeps its noise (``LoRA dropout mask`` N·in·e on a CPU, a bool N·in on CUDA) when that input needs
  grad (not, for example, q/k/v's in the first block of a LoRA run).

- with gradient checkpointing (``model.grad_checkpoint``) each block keeps only its input, N·C·s
  (``checkpointed block input``: the stream), and saves its terms again while the backward recomputes it.

Assumptions: one float dtype from each norm to the residual add (e) and one for the stream (s): an fp32 run,
or minituner.precision's bf16 compute (no autocast); the inputs x and y are contiguous (B, T) tensors; every
target counts (plain-text windows) unless ``counted`` says how many do. Where some do not (an instruction set's
prompts and padding), ``lm_loss`` runs the head on the n counted rows alone (``minigpt.train.counted_logits``):
the loss's N·V terms and its targets shrink to n rows (``targets`` n·8, ``log-softmax output`` n·V·4 or the
kept logits n·V·e and logsumexp n·4), a head that trains keeps its n input rows (n·C·e), and the row selection
keeps its ``counted-rows mask`` (B, T) bool, N bytes. ``counted`` None plans every position: for masked data
an upper bound (each row left out frees about V·e bytes) but for those N bytes. On CUDA the memory-efficient attention kernel
pads the logsumexp to a multiple of 32 positions and keeps two RNG scalars per layer (not modelled; a few bytes
per layer). The seed's B·T·d·L·16 and Korthikanti et al.'s 34·sbh + 5·as²b stay available as estimates for
comparison.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from minigpt import native_attention, native_loss, native_swiglu
from miniquant import nf4_amx, nf4_brgemm, nf4_matmul
from minituner import native_lora
from minigpt.bf16_support import bf16_support
from minigpt.cross_entropy import fp32_loss_chunked
from minigpt.errors import InputError
from minigpt.model import GPTConfig

from .counts import ALL_LINEAR, resolve_targets
from .shapes import LinearShape, ModelShape, minigpt_shape

INDEX_BYTES = 8  # int64 token ids, positions and targets
FP32 = 4  # logsumexp, log-softmax output, nll_loss's total_weight
# the widths (e, s, c) of a run at each --precision: fp32 throughout, or minituner.precision's bf16 compute
# (bf16 from each norm to the residual add, the fp32 stream and norms, bf16 copies of the fp32 LoRA masters)
PRECISION_WIDTHS = {"fp32": {"act_bytes": 4}, "bf16": {"act_bytes": 2, "stream_bytes": 4, "lora_copy_bytes": 2}}


def bf16_compute_attention(act_bytes: int, stream_bytes: int | None, seq_len: int, on_cpu: bool = True) -> bool:
    """Whether attention runs as ``minigpt.native_attention`` in the run these widths describe: minituner.precision's
    bf16 compute (a bf16 block, e = 2, beside the fp32 stream, s = 4) on a CPU where its kernels are built, at most
    its MAX_TOKENS tokens. A plain 16-bit plan (s = e = 2: MemoryConfig(dtype="fp16"/"bf16")) and a run on CUDA
    (on_cpu False) keep SDPA's terms."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and native_attention.takes_bf16_run(seq_len)


def bf16_compute_swiglu(act_bytes: int, stream_bytes: int | None, on_cpu: bool = True) -> bool:
    """Whether the llama family's SwiGLU gate runs as ``minigpt.native_swiglu`` in the run these widths describe:
    minituner.precision's bf16 compute (e = 2 beside s = 4) on a CPU where its kernels are built."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and native_swiglu.takes_bf16_run()


def bf16_compute_loss(act_bytes: int, stream_bytes: int | None, on_cpu: bool = True) -> bool:
    """Whether the loss reads the logits with ``minigpt.native_loss`` (a row at a time, no fp32 chunk) in the run
    these widths describe: minituner.precision's bf16 compute (e = 2 beside s = 4) on a CPU where its kernels are
    built (AVX-512)."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and native_loss.takes_bf16_logits()


def bf16_compute_lora(act_bytes: int, stream_bytes: int | None, rank: int, lora_dropout: float,
                      on_cpu: bool = True) -> bool:
    """Whether each LoRA layer's thin products run as ``minituner.native_lora`` in the run these widths describe:
    minituner.precision's bf16 compute (e = 2 beside s = 4) on a CPU where its kernels are built (AVX512-BF16), an
    even rank up to its MAX_RANK, no LoRA dropout. It reads the fp32 masters and saves them as they are: no bf16
    copies (``LoRA factor copies`` 0). The rest of what minituner.lora_product's fused Function and
    native_lora.fits ask (one active adapter, a frozen plain or quantized base without hooks, fp32 masters, inputs
    with contiguous rows) holds for every run the planner plans, as build_for_training and finetune make them."""
    return (on_cpu and act_bytes == 2 and stream_bytes == 4 and 0 < rank <= native_lora.MAX_RANK and rank % 2 == 0
            and not lora_dropout and native_lora.takes_bf16_run())


def bf16_compute_nf4(act_bytes: int, stream_bytes: int | None, on_cpu: bool = True) -> bool:
    """Whether the NF4 base's input gradients run as ``miniquant.nf4_matmul`` (the codes unpacked inside the
    product, each thread keeping a panel) in the run these widths describe: minituner.precision's bf16 compute
    (e = 2 beside s = 4) on a CPU where its kernel is built (AVX512-BF16); per weight, where its shape fits
    (``nf4_matmul.shape_fits``)."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and nf4_matmul.takes_bf16_run()


def bf16_compute_nf4_amx(act_bytes: int, stream_bytes: int | None, on_cpu: bool = True) -> bool:
    """Whether the NF4 base's products run as ``miniquant.nf4_amx`` (a GEMM on AMX's tiles, each thread keeping
    its sums in thread-local memory) in the run these widths describe: minituner.precision's bf16 compute (e = 2
    beside s = 4) on a CPU with AMX where the kernel runs; per weight, where it fits (``nf4_amx.weight_fits``)."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and nf4_amx.takes_bf16_run()


def bf16_compute_nf4_brgemm(act_bytes: int, stream_bytes: int | None, rows: int, on_cpu: bool = True) -> bool:
    """Whether the NF4 base's products of larger weights run as ``miniquant.nf4_brgemm`` (each weight unpacked
    panel by panel inside the product, each thread keeping its buffers; no workspace) in the run these widths
    describe: minituner.precision's bf16 compute (e = 2 beside s = 4) on a CPU with AMX where the kernel runs, the
    products' inputs of `rows` rows at most ``nf4_brgemm.MB``; per weight, where it fits
    (``nf4_brgemm.weight_fits``)."""
    return (on_cpu and act_bytes == 2 and stream_bytes == 4 and rows <= nf4_brgemm.MB
            and nf4_brgemm.takes_bf16_run())


def bf16_gemm_fallback(act_bytes: int, stream_bytes: int | None, on_cpu: bool = True) -> bool:
    """Whether the run these widths describe (minituner.precision's bf16 compute, e = 2 beside s = 4) multiplies
    bf16 on a CPU without bf16 units (``--allow-slow-bf16``). There PyTorch's bf16 products take a fallback that,
    for a transposed left operand, computes into an fp32 buffer the size of the output (M·N·4 bytes, measured);
    planner/peak.py counts the largest such buffer of a step."""
    return on_cpu and act_bytes == 2 and stream_bytes == 4 and not bf16_support("cpu").fast


QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
BLOCK_LINEARS = (*QKV, "attn.o_proj", "mlp.fc1", "mlp.fc2")
EXACT_FAMILIES = ("minigpt", "gpt2")  # GPT-2 as minituner trains it: imported into MiniGPT (as_minigpt)
# GPT-2's block Linears -> MiniGPT's (hf_gpt2 splits the fused c_attn into q/k/v)
GPT2_TO_MINIGPT = {"attn.c_attn": QKV, "attn.c_proj": ("attn.o_proj",), "mlp.c_fc": ("mlp.fc1",),
                   "mlp.c_proj": ("mlp.fc2",)}


def lora_paths(shape: ModelShape, targets: str | Iterable[str]) -> frozenset[str]:
    """Block paths (attn.q_proj, ...) carrying a LoRA adapter for these targets."""
    return frozenset(lin.path for lin in resolve_targets(shape, targets))


def lora_saved(lin: LinearShape, tokens: int, rank: int, act_bytes: int, lora_copy_bytes: int) -> Counter[str]:
    """What one LoRA layer's own path saves: A's output (N, r), and the per-call copies of A and B when it
    computes with cast copies of its masters (r·(in + out) elements of lora_copy_bytes; none when 0)."""
    saved = Counter({"LoRA A output": tokens * rank * act_bytes})
    if lora_copy_bytes:
        saved["LoRA factor copies"] = rank * (lin.in_features + lin.out_features) * lora_copy_bytes
    return saved


def check_dropout_range(p: float, what: str) -> None:
    if not 0.0 <= p < 1.0:  # also refuses nan
        raise InputError(f"{what} must be in [0, 1), got {p}")


def check_dropout(dropout: float, lora_dropout: float, on_cpu: bool) -> None:
    """The model's dropout is planned on a CPU (on CUDA SDPA's dropout runs in fused kernels not modelled here);
    LoRA's on either (a CPU keeps a float noise, CUDA a bool mask)."""
    check_dropout_range(dropout, "the model's dropout")
    check_dropout_range(lora_dropout, "LoRA dropout")
    if dropout and not on_cpu:
        raise InputError("the model's dropout is planned for CPU runs only (on CUDA attention's dropout runs in fused "
                         "kernels the exact model does not cover)")


def dropout_phrase(model_dropout: float, lora_dropout: float, lead: str = "") -> str:
    """"the model's dropout 0.1 and LoRA dropout 0.05" (after `lead`) for a run with dropout; "" without."""
    parts = ([f"the model's dropout {model_dropout:g}"] if model_dropout else []) + (
        [f"LoRA dropout {lora_dropout:g}"] if lora_dropout else [])
    return f"{lead}{' and '.join(parts)}" if parts else ""


def lora_dropout_saved(lin: LinearShape, tokens: int, act_bytes: int, input_hot: bool, on_cpu: bool) -> Counter[str]:
    """What LoRA dropout keeps on one layer's path: A's input is the dropped copy (N, in), its own (no longer the
    layer's shared input), and when that input needs grad the dropout keeps its mask: on a CPU a float noise
    tensor of the input's dtype (``F.dropout`` multiplies by it), on CUDA ``native_dropout``'s bool mask."""
    saved = Counter({"LoRA dropped input": tokens * lin.in_features * act_bytes})
    if input_hot:
        saved["LoRA dropout mask"] = tokens * lin.in_features * (act_bytes if on_cpu else 1)
    return saved


def math_attention_saved(batch_size: int, seq_len: int, d_model: int, n_head: int, q_hot: bool, k_hot: bool,
                         v_hot: bool) -> Counter[str]:
    """What SDPA's math path keeps, the path a CPU takes for attention with dropout: in fp32 (it upcasts bf16 and
    fp16 inputs), the scaled q and k of ``q·kᵀ`` (each kept for the other's gradient), the softmax's output,
    the dropout's float noise and the dropped probabilities (kept for v's gradient), and v (kept for the
    probabilities' gradient): the h·T² terms the fused kernels never keep."""
    N, scores = batch_size * seq_len, batch_size * n_head * seq_len * seq_len * FP32
    saved: Counter[str] = Counter()
    qk_hot = q_hot or k_hot
    saved["attention q, k, v"] += N * d_model * FP32 * (int(k_hot) + int(q_hot) + int(qk_hot))
    if qk_hot:
        saved["attention probabilities (h x T x T)"] += scores
        saved["attention dropout noise (h x T x T)"] += scores
    if v_hot:
        saved["attention dropped probabilities (h x T x T)"] += scores
    return +saved


@dataclass(frozen=True)
class MathAttention:
    """The last block's attention on SDPA's math path (the model's dropout), as planner/peak.py's phases need it."""

    scores: int  # bytes of one (B, h, T, T) fp32 tensor: the probabilities, their noise, the dropped copy
    kept: int  # how many of those three the block keeps for backward (0 to 3)
    qk_hot: bool  # q or k needs grad: the backward makes the gradients of the dropped and the plain probabilities
    v_hot: bool  # v needs grad: the dropped probabilities are kept, and v's gradient (N·C·4) is made
    v_grad: int  # bytes of v's gradient
    after: int  # what the block saves after its attention (o_proj on), freed before the attention's backward


@dataclass(frozen=True)
class SavedByLayer:
    """Bytes saved for backward, per term, where they are saved: before the blocks, in each block, after them."""

    embed: dict[str, int]  # the embedding lookups' indices (full FT only)
    blocks: tuple[dict[str, int], ...]  # one dict per block, in forward order
    head: dict[str, int]  # ln_f, the head's input (full FT), the loss
    math_attention: MathAttention | None = None  # the last block's, where attention has dropout

    def total(self) -> int:
        return sum(self.embed.values()) + sum(sum(b.values()) for b in self.blocks) + sum(self.head.values())

    def terms(self) -> dict[str, int]:
        out: Counter[str] = Counter(self.embed)
        for b in self.blocks:
            out.update(b)
        out.update(self.head)
        return dict(out)


def counted_rows(tokens: int, counted: int | None) -> int:
    """The rows the head and the loss run on: every position (counted None), or the n whose target counts
    (``minigpt.train.counted_logits``: an instruction batch's answers). 1 <= counted <= tokens."""
    if counted is None:
        return tokens
    if isinstance(counted, bool) or not isinstance(counted, int) or not 1 <= counted <= tokens:
        raise InputError(f"counted targets must be an integer from 1 to the batch's {tokens:,} positions, "
                         f"got {counted!r}")
    return counted


def loss_saved(terms: Counter[str], tokens: int, vocab: int, act_bytes: int, counted: int | None = None) -> None:
    """Add what ``minigpt.cross_entropy`` keeps for backward from logits of act_bytes per element to terms: for
    every position, or for the `counted` rows the head ran on, whose selection keeps its (B, T) bool mask."""
    n = counted_rows(tokens, counted)
    if n < tokens:  # counted_logits: h[keep] saves the mask for its backward (a scatter into every row)
        terms["counted-rows mask"] += tokens
    if act_bytes == FP32 and not fp32_loss_chunked(n, vocab):  # F.cross_entropy: log-softmax, then nll_loss
        terms["log-softmax output"] += n * vocab * FP32
    else:  # ChunkedCrossEntropy: the logits as they are, and one fp32 logsumexp per row
        terms["logits kept by the loss"] += n * vocab * act_bytes
        terms["loss logsumexp"] += n * FP32
    terms["targets"] += n * INDEX_BYTES
    terms["loss total_weight"] += FP32


LOSS_KEPT = ("log-softmax output", "logits kept by the loss", "loss logsumexp")  # freed by the loss's backward


def as_minigpt(shape: ModelShape, targets: str | Iterable[str] = ALL_LINEAR) -> tuple[ModelShape, tuple[str, ...]]:
    """The MiniGPT a shape trains as, and its LoRA targets: a GPT-2 shape is imported (c_attn split into
    q/k/v, c_proj -> o_proj, c_fc -> fc1, mlp.c_proj -> fc2), as ``minituner.hf_gpt2`` imports a folder."""
    if shape.family != "gpt2":
        return shape, tuple(lin.path for lin in resolve_targets(shape, targets))
    cfg = GPTConfig(vocab_size=shape.vocab_size, block_size=shape.n_positions, n_layer=shape.n_layer,
                    n_head=shape.n_head, d_model=shape.d_model, d_ff=shape.d_ff, bias=True,
                    tie_weights=shape.tie_embeddings)
    paths = tuple(p for lin in resolve_targets(shape, targets) for p in GPT2_TO_MINIGPT[lin.path])
    return minigpt_shape(cfg, shape.name), paths


def check_exact(shape: ModelShape, regime: str) -> None:
    if shape.family not in EXACT_FAMILIES:
        raise InputError(f"{shape.name}: the exact activation model covers MiniGPT (and GPT-2 imported into it), "
                         f"not {shape.family}; use the seed or korthikanti estimate")
    if shape.family == "minigpt" and tuple(lin.path for lin in shape.linears) != BLOCK_LINEARS:
        raise InputError(f"{shape.name}: not a MiniGPT block ({', '.join(BLOCK_LINEARS)})")
    if regime not in ("full", "lora", "qlora"):
        raise InputError(f"regime must be full, lora or qlora, got {regime!r}")


def minigpt_saved_by_layer(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full",
                           rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR,
                           act_bytes: int = 4, grad_checkpoint: bool = False, *, stream_bytes: int | None = None,
                           lora_copy_bytes: int = 0, on_cpu: bool = True, counted: int | None = None,
                           dropout: float = 0.0, lora_dropout: float = 0.0) -> SavedByLayer:
    """Bytes saved for backward by one MiniGPT training forward, per term and layer (see the module docstring).

    act_bytes is e, stream_bytes s (None: e), lora_copy_bytes c; counted: the positions whose target counts
    (None: all), the rows the head and the loss run on; dropout: the model's (GPTConfig.dropout: attention, residual
    and embedding dropout; CPU runs only), lora_dropout: LoRA's on its path's input. With ``grad_checkpoint`` each
    block keeps only its input (N·C·s, held by torch.utils.checkpoint to recompute the block in backward); what the
    block would save is saved again, one block at a time, during the backward
    (``minigpt_saved_by_layer(...).blocks`` without checkpointing gives it).
    """
    check_exact(shape, regime)
    check_dropout(dropout, lora_dropout, on_cpu)
    shape, targets = as_minigpt(shape, targets)
    full = regime == "full"
    lora = frozenset() if full else lora_paths(shape, targets)
    r = rank or 0
    N, C, F, h, e = batch_size * seq_len, shape.d_model, shape.d_ff, shape.n_head, act_bytes
    s = stream_bytes or act_bytes
    unfused = dropout > 0  # SDPA with dropout on a CPU: its math path, which keeps the h·T² probabilities
    native = not unfused and bf16_compute_attention(act_bytes, stream_bytes, seq_len, on_cpu)  # keeps no output
    linears = {lin.path: lin for lin in shape.linears}
    embed: Counter[str] = Counter()
    head: Counter[str] = Counter()
    blocks: list[dict[str, int]] = []

    def trains(path: str) -> bool:  # the layer's weight trains or a LoRA A reads (a dropped copy of) its input
        return full or path in lora

    def keeps_input(path: str) -> bool:  # the layer keeps its input itself (LoRA dropout: A keeps a dropped copy)
        return full or (path in lora and not lora_dropout)

    def layernorm(terms: Counter, hot: bool) -> None:
        if hot:
            terms["layernorm input"] += N * C * s
            terms["layernorm mean/rstd"] += 2 * N * s

    copies = 0 if bf16_compute_lora(e, stream_bytes, r, lora_dropout, on_cpu) else lora_copy_bytes

    def lora_out(terms: Counter, path: str, input_hot: bool) -> None:
        if path in lora:
            terms.update(lora_saved(linears[path], N, r, e, copies))
            if lora_dropout:
                terms.update(lora_dropout_saved(linears[path], N, e, input_hot, on_cpu))

    def dropped(terms: Counter, hot: bool, width: int) -> None:  # nn.Dropout on an (N, C) tensor
        if dropout and hot:
            terms["dropout noise"] += N * C * width

    if full:
        embed["token/position ids"] += N * INDEX_BYTES + (seq_len * INDEX_BYTES if shape.n_positions else 0)
        dropped(embed, True, s)  # the embeddings' dropout (their sum is in the stream's dtype)
    hot = full  # does the residual stream need grad?
    for _ in range(shape.n_layer):
        terms: Counter[str] = Counter()
        layernorm(terms, hot or full)  # ln_1 (its affine weights train in full FT)
        ln1_hot = hot or full
        if any(keeps_input(p) for p in QKV):
            terms["linear input"] += N * C * e  # ln_1's output, shared by q/k/v
        for p in QKV:
            lora_out(terms, p, ln1_hot)
        q_hot, k_hot, v_hot = (ln1_hot or trains(p) for p in QKV)
        attn_hot = q_hot or k_hot or v_hot
        if unfused:
            attention = math_attention_saved(batch_size, seq_len, C, h, q_hot, k_hot, v_hot)
            terms.update(attention)
        elif attn_hot:
            terms["attention q, k, v"] += 3 * N * C * e
            if not native:  # the fused kernel keeps its output; minigpt.native_attention does not
                terms["attention output"] += N * C * e
            if native and native_attention.keeps_probabilities(h, h, seq_len, C // h):
                terms["attention probabilities kept"] += h * N * seq_len * e  # P (B, h, T, T) in bf16
            else:
                terms["attention logsumexp"] += h * N * FP32
        before_o_proj = sum(terms.values())
        if keeps_input("attn.o_proj") and (native or unfused or not attn_hot):
            terms["linear input"] += N * C * e  # the attention output, not saved by attention itself
        lora_out(terms, "attn.o_proj", attn_hot)
        o_hot = attn_hot or trains("attn.o_proj")
        dropped(terms, o_hot, e)  # the attention's residual dropout
        hot = hot or o_hot
        layernorm(terms, hot or full)  # ln_2
        if keeps_input("mlp.fc1"):
            terms["linear input"] += N * C * e
        lora_out(terms, "mlp.fc1", hot or full)
        fc1_hot = hot or full or trains("mlp.fc1")
        if fc1_hot:
            terms["gelu input"] += N * F * e
        if keeps_input("mlp.fc2"):
            terms["linear input"] += N * F * e  # GELU's output
        lora_out(terms, "mlp.fc2", fc1_hot)
        fc2_hot = fc1_hot or trains("mlp.fc2")
        dropped(terms, fc2_hot, e)  # the MLP's residual dropout
        hot = hot or fc2_hot
        after_attention = sum(terms.values()) - before_o_proj
        blocks.append({"checkpointed block input": N * C * s} if grad_checkpoint else dict(terms))
    layernorm(head, hot or full)  # ln_f
    if full:
        head["linear input"] += counted_rows(N, counted) * C * e  # the (tied) head trains: it keeps its input rows
    loss_saved(head, N, shape.vocab_size, e, counted)
    math = None
    if unfused:  # the last block's attention
        scores = batch_size * h * seq_len * seq_len * FP32
        kept = sum(v for k, v in attention.items() if "(h x T x T)" in k) // scores
        math = MathAttention(scores, kept, q_hot or k_hot, v_hot, N * C * FP32, after_attention)
    return SavedByLayer(dict(embed), tuple(blocks), dict(head), math)


def minigpt_activation_terms(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full",
                             rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR,
                             act_bytes: int = 4, grad_checkpoint: bool = False) -> dict[str, int]:
    """Bytes saved for backward by one MiniGPT training forward, per term (see the module docstring)."""
    return minigpt_saved_by_layer(shape, batch_size, seq_len, regime, rank, targets, act_bytes, grad_checkpoint).terms()


def minigpt_activation_bytes(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full",
                             rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR,
                             act_bytes: int = 4, grad_checkpoint: bool = False) -> int:
    """Total bytes saved for backward by one MiniGPT training forward."""
    return minigpt_saved_by_layer(shape, batch_size, seq_len, regime, rank, targets, act_bytes, grad_checkpoint).total()

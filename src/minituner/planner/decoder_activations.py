"""Exact activation memory of the llama family (llama, mistral, qwen2) as ``minigpt.decoder.Decoder`` trains it.

The bytes its forward saves for backward, derived op by op from ``Decoder`` + ``minigpt.train.lm_loss``
as ``planner/activations.py`` does for MiniGPT, and checked against
``torch.autograd.graph.saved_tensors_hooks`` by ``minituner memory-check`` (each storage counted once,
parameters and buffers excluded). An op is recorded only when one of its inputs requires grad, and then
saves only what the gradients it must compute need, so what is saved depends on the regime: in full
fine-tuning the stream is "hot" from the embeddings on; in LoRA and QLoRA the frozen embeddings feed a
stream that needs no grad until the first LoRA layer.

With N = batch·seq tokens, T = seq, C = d_model, F = intermediate_size, h = query heads, d = head_dim,
V = vocab, r = LoRA rank, e = bytes per activation element between a norm and the residual add (4 for an
fp32 run, 2 under bf16 compute), s = bytes per element of the residual stream and of what the norms save
(``stream_bytes``: e unless given; 4 under bf16 compute), c = bytes per element of the per-call copies of
the LoRA factors (``lora_copy_bytes``: 0, or 2 under bf16 compute), the terms are:

- ``token ids``: the embedding lookup saves its int64 indices, N·8, in full FT only (rotary positions
  have no embedding).
- ``rotary cos/sin`` 2·T·d·e, once for the whole model: ``Decoder.rope`` builds cos and sin (T, d) once
  per forward, in the dtype q and k are in (``Decoder.compute_dtype``), and every layer's ``q * cos`` and
  ``swap_halves(q) * signed_sin(sin)`` (and k's) save the same two tensors, whenever q or k needs grad
  (swap_halves' chunk and cat save nothing).
- ``rmsnorm input`` N·C·s and ``rmsnorm rstd`` N·s, for input_layernorm, post_attention_layernorm (each
  layer) and the final norm, when the norm's input needs grad (``x.pow(2)`` and ``x * rsqrt(...)`` keep
  x, rsqrt keeps its output; x.float() is a no-op on the fp32 stream); ``rmsnorm normalized input`` N·C·s
  when its weight trains (full FT: ``weight * x_normed`` keeps x_normed). Under bf16 compute the forward
  hook that casts the norm's output to bf16 saves nothing.
- ``linear input``: a Linear whose weight trains (full FT) or that carries a LoRA A keeps its input:
  N·C·e for q/k/v (one shared input) and for gate/up (one shared input), N·F·e for down_proj (the
  SwiGLU product), and N·h·d·e for o_proj only when attention recorded nothing (otherwise its input is
  the attention output, a view of a storage already counted). A frozen Linear keeps only its weight.
- ``LoRA A output`` N·r·e per LoRA layer (B's weight gradient needs it); QLoRA's
  ``DequantLinearFunction`` saves only the quantized buffers (the weights bucket), never the
  dequantized weight, which lives in one reused workspace (planner/peak.py counts it).
- ``LoRA factor copies`` r·(in + out)·c per LoRA layer: the bf16 copies of the fp32 masters that each
  LoRALinear makes per call under bf16 compute and ``LoRAUpdate`` saves (activations, not parameters); none
  where ``minituner.native_lora`` runs (``bf16_compute_lora``), which reads and saves the masters themselves.
- ``attention q, k, v`` 3·N·h·d·e, ``attention output`` N·h·d·e and ``attention logsumexp`` h·N·4
  (fp32): on CPU ``F.scaled_dot_product_attention`` without dropout runs the fused flash kernel, which
  keeps its inputs, its output and one logsumexp per query and head, never the h·T² scores. Its inputs
  are the rotated q (a new tensor) and the rotated k and v (v a view of v_proj's output). Under
  grouped-query attention k and v stay at num_key_value_heads (kv·d wide: ``enable_gqa``, where the CPU
  flash kernel takes it, ``minigpt.decoder.cpu_flash_takes_gqa``: torch 2.9 on), so the term is
  N·(h + 2·kv)·d·e; otherwise the decoder repeats them to h heads with ``repeat_interleave`` first
  (3·N·h·d·e: its own backward saves nothing, and the narrower k/v before it are not kept). The output is laid out (B, T, h, d), so o_proj's input is a view of it.
  Under bf16 compute on a CPU where ``minigpt.native_attention`` runs (its kernels built, T at most its
  ``MAX_TOKENS``), attention saves q, k and v (k and v at their kv heads) and the logsumexp, not its output:
  o_proj keeps that (N·h·d·e, ``linear input``) when it trains. Where its probabilities take no more than q, k
  and v (``native_attention.keeps_probabilities``: h·T <= (h + 2·kv)·d, short sequences) it keeps them instead
  of the logsumexp (``attention probabilities kept`` h·N·T·e).
- ``attention mask`` T·T·e per sliding-window layer when T exceeds the window (Mistral, Qwen2 with
  use_sliding_window): the boolean (T, T) mask is converted to the query's dtype and kept by the kernel
  (not under ``minigpt.native_attention``, which applies the window by index).
- ``silu input`` N·F·e (gate_proj's output), ``silu output`` N·F·e and ``up output`` N·F·e: SwiGLU's
  ``act(gate) * up`` keeps each factor for the other's gradient (act(gate) when up needs grad, up when
  gate does); any ``hidden_act`` of the Decoder keeps its input. Under bf16 compute on a CPU where
  ``minigpt.native_swiglu`` runs (its kernels built), the gate is one Function that keeps gate's output when
  either input needs grad and up's when gate does, and recomputes act(gate): no ``silu output``.
- the loss's terms (``log-softmax output`` N·V·4 from fp32 logits, or ``logits kept by the loss`` N·V·e and
  ``loss logsumexp`` N·4 from narrower ones; ``targets`` N·8, ``loss total_weight`` 4): as MiniGPT's, over the
  n counted rows when ``counted`` says how many targets count (with the N-byte ``counted-rows mask``).

- with gradient checkpointing (``model.grad_checkpoint``) each layer keeps only its input, N·C·s
  (``checkpointed block input``: the stream), and torch.utils.checkpoint holds the rotary cos/sin it was
  called with (2·T·d·e, once: every layer gets the same two tensors); the layer's terms are saved again,
  one layer at a time, while the backward recomputes it.

- with LoRA dropout (``lora_dropout``) each LoRA layer keeps its own dropped copy of its input and, when that input
  needs grad, the dropout's noise: as MiniGPT's (``planner/activations.py``, ``lora_dropout_saved``).

Assumptions: attention dropout 0 (llama, mistral and qwen2 checkpoints train without it; a config with it is
refused; memory-check --model-dropout 0 measures such a model without it), one float dtype from each norm to the
residual add (e) and one for the stream (s): an fp32 run, or minituner.precision's bf16 compute (no autocast);
contiguous (B, T) inputs; biases change nothing here (their gradient is a sum of the output's); every target
counts unless ``counted`` says how many do (``planner/activations.py`` says what a masked batch changes).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from minigpt import native_attention
from minigpt.decoder import cpu_flash_takes_gqa
from minigpt.errors import InputError

from .activations import EXACT_FAMILIES as MINIGPT_FAMILIES
from .activations import (FP32, INDEX_BYTES, SavedByLayer, bf16_compute_attention, bf16_compute_lora,
                          bf16_compute_swiglu, check_dropout, counted_rows, lora_dropout_saved, loss_saved, lora_paths,
                          lora_saved, minigpt_saved_by_layer)
from .counts import ALL_LINEAR
from .shapes import ModelShape

LLAMA_FAMILIES = ("llama", "mistral", "qwen2")  # minigpt.decoder.Decoder: RMSNorm, rotary, SwiGLU, GQA
EXACT_FAMILIES = (*MINIGPT_FAMILIES, *LLAMA_FAMILIES)
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LAYER_LINEARS = (*QKV, "self_attn.o_proj", *GATE_UP, "mlp.down_proj")


def check_decoder(shape: ModelShape, regime: str) -> None:
    if shape.family not in LLAMA_FAMILIES:
        raise InputError(f"{shape.name}: not a llama-family shape ({', '.join(LLAMA_FAMILIES)}): {shape.family}")
    if tuple(lin.path for lin in shape.linears) != LAYER_LINEARS:
        raise InputError(f"{shape.name}: not a llama-family layer ({', '.join(LAYER_LINEARS)})")
    if regime not in ("full", "lora", "qlora"):
        raise InputError(f"regime must be full, lora or qlora, got {regime!r}")


def decoder_saved_by_layer(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full",
                           rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR,
                           act_bytes: int = 4, grad_checkpoint: bool = False, *, stream_bytes: int | None = None,
                           lora_copy_bytes: int = 0, on_cpu: bool = True, counted: int | None = None,
                           dropout: float = 0.0, lora_dropout: float = 0.0) -> SavedByLayer:
    """Bytes saved for backward by one Decoder training forward, per term and layer (see the module docstring):
    act_bytes is e, stream_bytes s (None: e), lora_copy_bytes c; on_cpu False: a CUDA run (SDPA, k/v repeated);
    counted: the positions whose target counts (None: all), the rows the head and the loss run on; lora_dropout:
    LoRA's dropout on its path's input. The model's own attention dropout (``dropout``) is not modelled."""
    check_decoder(shape, regime)
    if dropout:
        raise InputError(f"{shape.name}: the model's dropout ({dropout:g}) is not modelled for the llama family "
                         "(llama, mistral and qwen2 checkpoints train without attention dropout)")
    check_dropout(0.0, lora_dropout, on_cpu)
    full = regime == "full"
    lora = frozenset() if full else lora_paths(shape, targets)
    r = rank or 0
    N, T, C, F, e = batch_size * seq_len, seq_len, shape.d_model, shape.d_ff, act_bytes
    s = stream_bytes or act_bytes
    linears = {lin.path: lin for lin in shape.linears}
    A = shape.n_head * shape.head_dim  # attention width: q (and k/v repeated to h heads without enable_gqa)
    native = bf16_compute_attention(e, stream_bytes, T, on_cpu)  # minigpt.native_attention: no mask, kv heads
    fused_gate = bf16_compute_swiglu(e, stream_bytes, on_cpu)  # minigpt.native_swiglu: act(gate) not kept
    grouped = native or (on_cpu and cpu_flash_takes_gqa())  # k, v kept at their kv heads (else repeated to h)
    KV = (shape.n_kv_head if grouped else shape.n_head) * shape.head_dim  # k, v as attention keeps them
    embed: Counter[str] = Counter()
    head: Counter[str] = Counter()
    blocks: list[dict[str, int]] = []
    rope_saved = False

    def trains(path: str) -> bool:  # the layer's weight trains or a LoRA A reads (a dropped copy of) its input
        return full or path in lora

    def keeps_input(path: str) -> bool:  # the layer keeps its input itself (LoRA dropout: A keeps a dropped copy)
        return full or (path in lora and not lora_dropout)

    def rmsnorm(terms: Counter, hot: bool) -> None:
        if hot:
            terms["rmsnorm input"] += N * C * s
            terms["rmsnorm rstd"] += N * s
        if full:
            terms["rmsnorm normalized input"] += N * C * s

    copies = 0 if bf16_compute_lora(e, stream_bytes, r, lora_dropout, on_cpu) else lora_copy_bytes

    def lora_out(terms: Counter, path: str, input_hot: bool) -> None:
        if path in lora:
            terms.update(lora_saved(linears[path], N, r, e, copies))
            if lora_dropout:
                terms.update(lora_dropout_saved(linears[path], N, e, input_hot, on_cpu))

    if full:
        embed["token ids"] += N * INDEX_BYTES
    hot = full  # does the residual stream need grad?
    for i in range(shape.n_layer):
        terms: Counter[str] = Counter()
        rmsnorm(terms, hot)  # input_layernorm
        x_hot = hot or full  # its output needs grad (its weight trains in full FT)
        if any(keeps_input(p) for p in QKV):
            terms["linear input"] += N * C * e  # input_layernorm's output, shared by q/k/v
        for p in QKV:
            lora_out(terms, p, x_hot)
        q_hot, k_hot, v_hot = (x_hot or trains(p) for p in QKV)
        rope_saved = rope_saved or q_hot or k_hot
        attn_hot = q_hot or k_hot or v_hot
        if attn_hot:
            terms["attention q, k, v"] += N * (A + 2 * KV) * e
            if not native:  # the fused kernel keeps its output; minigpt.native_attention does not
                terms["attention output"] += N * A * e
            if native and native_attention.keeps_probabilities(shape.n_head, shape.n_kv_head, T, shape.head_dim):
                terms["attention probabilities kept"] += shape.n_head * N * T * e  # P (B, h, T, T) in bf16
            else:
                terms["attention logsumexp"] += shape.n_head * N * FP32
            if (shape.sliding_window is not None and i in shape.sliding_layers and T > shape.sliding_window
                    and not native):
                terms["attention mask"] += T * T * e
        if keeps_input("self_attn.o_proj") and (native or not attn_hot):
            terms["linear input"] += N * A * e  # the attention output, not saved by attention itself
        lora_out(terms, "self_attn.o_proj", attn_hot)
        hot = hot or attn_hot or trains("self_attn.o_proj")
        rmsnorm(terms, hot)  # post_attention_layernorm
        x_hot = hot or full
        if any(keeps_input(p) for p in GATE_UP):
            terms["linear input"] += N * C * e  # post_attention_layernorm's output, shared by gate/up
        for p in GATE_UP:
            lora_out(terms, p, x_hot)
        gate_hot, up_hot = (x_hot or trains(p) for p in GATE_UP)
        if gate_hot or (up_hot and fused_gate):
            terms["silu input"] += N * F * e
        if gate_hot:
            terms["up output"] += N * F * e
        if up_hot and not fused_gate:
            terms["silu output"] += N * F * e
        if keeps_input("mlp.down_proj"):
            terms["linear input"] += N * F * e  # the SwiGLU product
        lora_out(terms, "mlp.down_proj", gate_hot or up_hot)
        hot = hot or gate_hot or up_hot or trains("mlp.down_proj")
        blocks.append({"checkpointed block input": N * C * s} if grad_checkpoint else dict(terms))
    if rope_saved or grad_checkpoint:  # one cos and one sin for every layer (checkpointing holds them as inputs)
        embed["rotary cos/sin"] += 2 * T * shape.head_dim * e
    rmsnorm(head, hot)  # the final norm
    if full:
        head["linear input"] += counted_rows(N, counted) * C * e  # lm_head trains (tied or not): keeps its input rows
    loss_saved(head, N, shape.vocab_size, e, counted)
    return SavedByLayer(dict(embed), tuple(blocks), dict(head))


def saved_by_layer(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full", rank: int | None = None,
                   targets: str | Iterable[str] = ALL_LINEAR, act_bytes: int = 4, grad_checkpoint: bool = False, *,
                   stream_bytes: int | None = None, lora_copy_bytes: int = 0, on_cpu: bool = True,
                   counted: int | None = None, dropout: float = 0.0, lora_dropout: float = 0.0) -> SavedByLayer:
    """The exact model of this shape's family: MiniGPT (and GPT-2 imported into it) or the llama family."""
    fn = decoder_saved_by_layer if shape.family in LLAMA_FAMILIES else minigpt_saved_by_layer
    return fn(shape, batch_size, seq_len, regime, rank, targets, act_bytes, grad_checkpoint,
              stream_bytes=stream_bytes, lora_copy_bytes=lora_copy_bytes, on_cpu=on_cpu, counted=counted,
              dropout=dropout, lora_dropout=lora_dropout)


def exact_activation_bytes(shape: ModelShape, batch_size: int, seq_len: int, regime: str = "full",
                           rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR, act_bytes: int = 4,
                           grad_checkpoint: bool = False, *, stream_bytes: int | None = None,
                           lora_copy_bytes: int = 0, on_cpu: bool = True, counted: int | None = None,
                           dropout: float = 0.0, lora_dropout: float = 0.0) -> int:
    """Total bytes saved for backward by one training forward of this shape (any family with an exact model)."""
    return saved_by_layer(shape, batch_size, seq_len, regime, rank, targets, act_bytes, grad_checkpoint,
                          stream_bytes=stream_bytes, lora_copy_bytes=lora_copy_bytes, on_cpu=on_cpu,
                          counted=counted, dropout=dropout, lora_dropout=lora_dropout).total()

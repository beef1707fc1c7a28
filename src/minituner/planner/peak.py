"""The peak of a training step: what is alive at its worst moment, phase by phase, by arithmetic alone.

A step of ``minigpt.train.train`` (and of ``minituner memory-check``) runs: forward and loss (the previous
step's grads still alive), ``zero_grad(set_to_none=True)``, backward, gradient clipping, AdamW's step.
Each phase below lists the tensors alive at its worst moment; the planner's peak is the largest phase.
Measured on CPU (resident-set high-water mark per phase, see ``minituner.memory.check`` and
benchmarks/memory_sweep.md), the peak is in the backward at the loss (every saved activation still
alive, plus the loss's (N, V) gradients) for LoRA, QLoRA and full FT without
checkpointing; with gradient checkpointing it moves to the last block's backward (the recomputed block
plus its gradients) unless the logits dominate (GPT-2's 50,257-token vocabulary: still at the loss);
full FT of a large-vocabulary model peaks at the embeddings' backward (every grad plus the embedding's
V x C gradient temporaries; fused AdamW's step holds only weights, grads and its state); a small full FT run can peak at the end of the
forward (the last step's grads are still alive there).

With N = batch·seq, C = d_model, F = d_ff, V = vocab, the exact activation model's widths e (bytes per
element from each norm to the residual add), s (the residual stream's, e unless given) and c (the LoRA
factors' per-call copies) of ``planner/activations.py`` (an fp32 run: e = s = 4, c = 0; bf16 compute:
e = 2, s = 4, c = 2), and the weights/grads/optimizer buckets W, G, O of ``regime_bytes`` (A = the bytes
saved for backward, at those widths). For QLoRA, W in every phase below includes the dequantization
workspace: every NF4 weight is dequantized into one buffer the size of the largest, out·in·e, reused by
every layer in forward and backward and kept from the first step on (``miniquant.quantize``); where the input's
gradient runs as ``miniquant.nf4_matmul`` (bf16 on a CPU with AVX512-BF16), each thread also keeps its panel and
sums (``nf4_matmul.scratch_bytes``: 128 KiB, and (N + 14)·512 bytes for an out_features over 512, and 15,232 bytes
where an out_features is a multiple of 2,048: its copy of 14 rows of the gradient), and where the
adapter's share of that gradient is added inside the product (``minituner.native_lora`` running: an even rank r, no
LoRA dropout) the adapter's panel, r·256 bytes; where the products of NF4 weights of at most 2^20 values run as
``miniquant.nf4_amx`` (bf16 on a CPU with AMX), each thread keeps its sums in thread-local memory
(``nf4_amx.scratch_bytes``: 64 KiB); the larger ones, where N is at most 512, run as ``miniquant.nf4_brgemm``,
which unpacks them inside its product, so the workspace is only as large as the largest other NF4 weight (none
where there is no other), and its threads keep their buffers (``nf4_brgemm.scratch_bytes``: 1 MiB each, and
64·k bytes for the last rows, k the widest product's; PyTorch's compiled brgemm kernels, about 190 KiB a shape per
thread, are not counted). The
head returns
its logits in the block's dtype e, and the loss (``minigpt.cross_entropy``) reads them as they are: fp32 logits
through ``F.cross_entropy``, narrower ones in fp32 chunks of R = ``chunk_rows(V)`` rows (CPU's chunk, about
2 MiB; on CUDA the loss takes 64 MiB chunks, so its 2·R·V·4 term below is up to 128 MiB larger there than
planned). bf16 logits on a CPU where ``minigpt.native_loss`` runs (a C compiler is present and the CPU has
AVX-512) make no fp32 chunk at all, and none is planned there (``activations.bf16_compute_loss``). In a batch
where only n of the N targets count (``counted``: an instruction batch's answers) the head and the loss run on
those n rows (``minigpt.train.counted_logits``), so every logit, loss and head term below is over n rows, not N.
The phases:

- forward (loss): W + O + G (last step's grads: zero_grad comes after the forward) + A + with fp32 logits
  the logits N·V·4 beside the log-softmax output (in A); with narrower ones, A holds the logits the loss keeps
  and the loss's chunk temporaries are alive, 2·R·V·4 (a chunk upcast to fp32 and logsumexp's shifted copy).
- backward, loss: W + O + A + the gradients it makes (G was set to None): with fp32 logits 2·N·V·4
  (nll_loss's gradient and log-softmax's, both (N, V) fp32, while log-softmax's saved output is alive);
  with narrower ones one fp32 chunk R·V·4: the logit gradient is written over the logits the loss kept (in A;
  ``minigpt.train``'s losses pass ``overwrite_logits``).
- fp32 logits of at least ``minigpt.cross_entropy.fp32_loss_chunked``'s size (Llama 3's or GPT-2's vocabulary
  at a few hundred tokens) take the chunked path too: A holds the logits the loss keeps, the forward adds
  logsumexp's shifted copy of one chunk R·V·4, and the backward computes the softmax over the logits in place
  (nothing more).
- backward, head: W + O + A - what the loss kept + the head's gradients (``head_gradients``): the logit
  gradient N·V·e (with narrower logits, where the loss kept them) while the head makes its input gradient
  N·C·e; + the head's weight gradient V·C·4 when it trains (full FT).
- backward, last block: W + O + the grads produced so far (full FT: head and one block; LoRA: one
  block's factors) + A minus what the head saved + the block's gradients (the residual stream's N·C·s,
  fp32 under bf16 compute, and the MLP's N·F·e) + with gradient checkpointing the block's recomputed
  saved tensors.
  On a CPU without bf16 units (bf16 under ``--allow-slow-bf16``) LoRA's input gradient (N, in), a product
  whose left operand is transposed, goes through PyTorch's fallback GEMM and its fp32 output buffer
  (``activations.bf16_gemm_fallback``): for the block's widest target the moment of that product, the
  residual stream's gradient + N·in·(e + 4) with the target's saved input still alive, when it is the larger.
- the last block's attention with the model's dropout (MiniGPT and GPT-2; ``math_attention_phases``): SDPA's
  math path makes three (B, h, T, T) fp32 tensors in its forward (the probabilities, their noise, the dropped
  copy), kept or not: W + O + G + A minus what the head and the block after its attention saved, minus those of
  the three it keeps, + all three (with checkpointing, in "forward, last block" below). Its backward, at the
  dropout, makes two such gradients (the dropped and the plain probabilities') after its product with v freed
  the dropped copy (when kept): W + O + the grads so far + A minus what the head and the block after its
  attention saved (freed by then) + those two gradients, v's gradient N·C·4 and the residual stream's N·C·s
  (with checkpointing, the recomputed block's saved tensors on top). With many heads over long windows and a
  small vocabulary one of them is the step's peak (measured: 18% to 92% above the other phases).
- forward, last block (gradient checkpointing only): W + O + G + A minus the head's + what the block would
  save, alive until it returns, + with the model's dropout those of attention's three (B, h, T, T) tensors it
  would not keep (without checkpointing this moment is below the loss's).
- backward, embeddings (full FT): W + O + G, + V·C·4 when tied. G counts the embedding's .grad as made; an
  untied embedding's dense gradient becomes that .grad. A tied weight's two gradients (the head's, which
  waits in autograd's buffer, and the lookup's) are both alive before they are summed into it: one V·C·4
  more than G (the head's a fresh tensor, as ``minikernels.fp32_gemm`` makes it on CPU: F.linear's is a view,
  into which autograd cannot add the lookup's in place, one V·C·4 more again). Under gradient accumulation
  each new gradient is added into a .grad that already exists: one V·C·4 more (``accumulating``). Measured
  (memory-check, vocab 50,000, d_model 512, 1 × 64 tokens): tied 537.1 MiB against W + O + G + V·C·4 = 537.0;
  untied, the embeddings' phase stays below the forward's.
- optimizer step: W + G + O (minigpt.train's AdamW is PyTorch's fused kernel on CPU and CUDA, which updates
  every tensor in place and allocates nothing; gradient clipping adds nothing). Torch's default off CUDA,
  the single-tensor loop, would add two temporaries of the largest trainable tensor's size.
- bf16 compute on a CPU without gradient checkpointing: logits of at least ``large_output.MAPPED_BYTES``
  (n·V·2) are written into the memory of the last step's (``precision.keep_head_output``), kept from step to
  step: every phase but the loss's and the head's, which count them already, holds them too (``kept_logits``).

With gradient accumulation (``grad_accum`` micro-batches of batch·seq per step, ``accumulating``) each
micro-batch's phases are the ones above, except that every backward after the first holds all of G (the step's
gradients so far, added into) in place of the grads made so far.

Not modelled: the process itself (Python, libraries, allocator slack; ``memory-check`` measures it as
its own line).
Each architecture has its own phase function in ``PEAK_MODELS``, over the phases above (``step_phases``):
``minigpt_phases`` (MiniGPT, GPT-2) and ``llama_phases`` (llama, mistral, qwen2 as ``minigpt.decoder.Decoder``
trains them: the exact model of ``decoder_activations.py``; in the last block's backward SwiGLU's product
has three (N, F) gradients alive at once, the one arriving from down_proj and the silu output's and up's,
less down_proj's saved input when it was saved).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from minigpt.cross_entropy import chunk_rows, fp32_loss_chunked
from minikernels import large_output
from miniquant import nf4_amx, nf4_brgemm, nf4_matmul

from .activations import (FP32, LOSS_KEPT, MathAttention, SavedByLayer, as_minigpt, bf16_compute_loss,
                          bf16_compute_lora, bf16_compute_nf4, bf16_compute_nf4_amx, bf16_compute_nf4_brgemm,
                          bf16_gemm_fallback, counted_rows,
                          lora_paths, minigpt_saved_by_layer)
from .decoder_activations import decoder_saved_by_layer
from .counts import ALL_LINEAR, NF4_BLOCK, resolve_targets, total_params
from .shapes import ModelShape

GRADS_SO_FAR = "grads so far (head, last block)"  # a backward phase's term for the gradients made before it


@dataclass(frozen=True)
class Peak:
    phase: str  # the phase where the step peaks
    phases: dict[str, dict[str, int]]  # every phase's live tensors, term -> bytes

    @property
    def terms(self) -> dict[str, int]:
        return self.phases[self.phase]

    @property
    def bytes(self) -> int:
        return sum(self.terms.values())

    def to_dict(self) -> dict:
        return {"phase": self.phase, "bytes": self.bytes, "terms": self.terms,
                "phases": {k: sum(v.values()) for k, v in self.phases.items()}}


def minigpt_phases(shape: ModelShape, regime: str, rank: int | None, targets: str | Iterable[str],
                   batch_size: int, seq_len: int, act_bytes: int, grad_checkpoint: bool,
                   weights: int, grads: int, optimizer: int, grad_bytes: int, *, stream_bytes: int | None = None,
                   lora_copy_bytes: int = 0, on_cpu: bool = True, upcast: Collection[str] = (),
                   counted: int | None = None, dropout: float = 0.0, lora_dropout: float = 0.0
                ) -> dict[str, dict[str, int]]:
    """Live bytes per term at the worst moment of each phase of one MiniGPT (or GPT-2) training step."""
    shape, targets = as_minigpt(shape, targets)  # GPT-2 trains as the MiniGPT it imports into
    N, C, F = batch_size * seq_len, shape.d_model, shape.d_ff
    # the last block's backward: the residual stream's gradient (the stream's dtype) and one (N, F) in the MLP
    # (GELU's input gradient, in the block's dtype; fc2's saved input is freed as GELU's gradient appears)
    block_grads = N * C * (stream_bytes or act_bytes) + N * F * act_bytes
    return step_phases(shape, regime, rank, targets, batch_size, seq_len, act_bytes, grad_checkpoint, weights, grads,
                       optimizer, grad_bytes, minigpt_saved_by_layer, block_grads, stream_bytes=stream_bytes,
                       lora_copy_bytes=lora_copy_bytes, on_cpu=on_cpu, upcast=upcast, counted=counted,
                       dropout=dropout, lora_dropout=lora_dropout)


def llama_phases(shape: ModelShape, regime: str, rank: int | None, targets: str | Iterable[str],
                 batch_size: int, seq_len: int, act_bytes: int, grad_checkpoint: bool,
                 weights: int, grads: int, optimizer: int, grad_bytes: int, *, stream_bytes: int | None = None,
                 lora_copy_bytes: int = 0, on_cpu: bool = True, upcast: Collection[str] = (),
                 counted: int | None = None, dropout: float = 0.0, lora_dropout: float = 0.0
                ) -> dict[str, dict[str, int]]:
    """Live bytes per term at the worst moment of each phase of one llama / mistral / qwen2 (Decoder) step."""
    N, C, F = batch_size * seq_len, shape.d_model, shape.d_ff
    down_saved = regime == "full" or "mlp.down_proj" in lora_paths(shape, targets)
    # SwiGLU's backward at its product: the gradient arriving from down_proj and the two it makes (silu output's
    # and up's), all (N, F) in the block's dtype, beside the residual stream's (N, C) in the stream's;
    # down_proj's saved input is freed by then
    mlp = (3 - (1 if down_saved else 0)) * N * F
    block_grads = N * C * (stream_bytes or act_bytes) + mlp * act_bytes
    return step_phases(shape, regime, rank, targets, batch_size, seq_len, act_bytes, grad_checkpoint, weights, grads,
                       optimizer, grad_bytes, decoder_saved_by_layer, block_grads, stream_bytes=stream_bytes,
                       lora_copy_bytes=lora_copy_bytes, on_cpu=on_cpu, upcast=upcast, counted=counted,
                       dropout=dropout, lora_dropout=lora_dropout)


def kept_logits(tokens: int, vocab: int, act_bytes: int, stream_bytes: int | None, on_cpu: bool,
                grad_checkpoint: bool) -> int:
    """Bytes of the logits a bf16 run's head keeps from step to step (``precision.keep_head_output``): bf16 compute
    (e = 2 beside s = 4) on a CPU, no gradient checkpointing, (tokens, vocab) bf16 logits that large_output
    writes (at least its MAPPED_BYTES); else 0."""
    nbytes = tokens * vocab * act_bytes
    bf16_cpu = on_cpu and act_bytes == 2 and stream_bytes == 4
    return nbytes if bf16_cpu and not grad_checkpoint and nbytes >= large_output.MAPPED_BYTES else 0


def head_gradients(tokens: int, d_model: int, vocab: int, act_bytes: int) -> dict[str, int]:
    """The head's backward at its worst moment: the logit gradient (N, V) the loss hands it, in the logits'
    dtype, alive while the head's product makes the input gradient (N, C)."""
    return {"logit gradient (N x V)": tokens * vocab * act_bytes, "head input gradient": tokens * d_model * act_bytes}


def loss_phases(tokens: int, vocab: int, act_bytes: int, native: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """The loss's own tensors at its forward's and its backward's worst moments (beside the saved activations);
    native: bf16 logits read by minigpt.native_loss's kernels, a row at a time (no fp32 chunk)."""
    N, V, e = tokens, vocab, act_bytes
    if native:  # bf16 logits only (activations.bf16_compute_loss)
        return {}, {}
    if e == FP32 and not fp32_loss_chunked(N, V):  # F.cross_entropy: the logits beside log-softmax's output;
        # nll_loss's and log-softmax's gradients
        return {"logits": N * V * FP32}, {"nll and log-softmax gradients (N x V, fp32)": 2 * N * V * FP32}
    # minigpt.cross_entropy's chunks: the logits stay in their dtype, and their gradient is written over them
    rows = min(N, chunk_rows(V))
    if e == FP32:  # no upcast copy; the backward's softmax is computed over the logits themselves
        return {"loss chunk (logsumexp's shifted copy)": rows * V * FP32}, {}
    return ({"loss chunk (fp32 copy and logsumexp's shifted copy)": 2 * rows * V * FP32},
            {"loss chunk (fp32 softmax)": rows * V * FP32})


def step_phases(shape: ModelShape, regime: str, rank: int | None, targets: str | Iterable[str],
                batch_size: int, seq_len: int, act_bytes: int, grad_checkpoint: bool,
                weights: int, grads: int, optimizer: int, grad_bytes: int,
                saved_by_layer: Callable[..., SavedByLayer], block_grads: int, *, stream_bytes: int | None = None,
                lora_copy_bytes: int = 0, on_cpu: bool = True, upcast: Collection[str] = (),
                counted: int | None = None, dropout: float = 0.0, lora_dropout: float = 0.0
                ) -> dict[str, dict[str, int]]:
    """The phases of a step for a family's saved-tensor model and its last block's backward gradients (bytes).

    upcast: the paths of the block Linears of a 16-bit base computed in fp32 (LoRA or QLoRA) that are upcast per
    product (``upcast.UpcastLinear``: kept 16-bit, not quantized) into the same workspace NF4 dequantizes into.
    counted: the positions whose target counts (None: all), the rows the head and the loss run on. dropout: the
    model's (MiniGPT and GPT-2, on a CPU); lora_dropout: LoRA's on its path's input."""
    widths = {"stream_bytes": stream_bytes, "lora_copy_bytes": lora_copy_bytes, "on_cpu": on_cpu, "counted": counted,
              "dropout": dropout, "lora_dropout": lora_dropout}
    saved = saved_by_layer(shape, batch_size, seq_len, regime, rank, targets, act_bytes, grad_checkpoint, **widths)
    plain = saved_by_layer(shape, batch_size, seq_len, regime, rank, targets, act_bytes, **widths) \
        if grad_checkpoint else saved
    N, C, V, e = batch_size * seq_len, shape.d_model, shape.vocab_size, act_bytes
    n = counted_rows(N, counted)  # the head's and the loss's rows
    A, full = saved.total(), regime == "full"
    head_saved = sum(saved.head.values())
    embedding = V * C * FP32  # the token embedding (and a tied head): its gradient is fp32 like Adam's state
    base = {"weights": weights, "optimizer state": optimizer}
    # every NF4 weight is dequantized (and a 16-bit one upcast) into one reused buffer, kept from the first step on,
    # but for the larger NF4 weights nf4_brgemm unpacks inside its product (bf16 on a CPU with AMX): its threads'
    # buffers instead
    quantized = set(lora_paths(shape, targets)) if regime == "qlora" else set()
    upcasts = set(upcast) - quantized if regime != "full" else set()
    unpacked = {lin.path for lin in shape.linears if lin.path in quantized
                and nf4_brgemm.weight_fits(lin.in_features, lin.out_features, NF4_BLOCK)} \
        if bf16_compute_nf4_brgemm(e, stream_bytes, N, on_cpu) else set()
    if unpacked:  # (k: the widest product's, the forward's in or the input gradient's out)
        k = max(max(lin.in_features, lin.out_features) for lin in shape.linears if lin.path in unpacked)
        base["NF4 brgemm panels (nf4_brgemm, per thread)"] = nf4_brgemm.scratch_bytes(nf4_matmul.team_threads(), k)
    if (quantized - unpacked) or upcasts:
        name = " and ".join([*(["NF4 dequantization"] if quantized - unpacked else []),
                             *(["16-bit upcast"] if upcasts else [])])
        base[f"{name} workspace"] = max(lin.weight_params for lin in shape.linears
                                        if lin.path in (quantized - unpacked) | upcasts) * e
    # where nf4_matmul computes an NF4 weight's input gradient (bf16 on a CPU with AVX512-BF16), its threads' panels
    in_c = [lin for lin in shape.linears if lin.path in quantized and bf16_compute_nf4(e, stream_bytes, on_cpu)
            and nf4_matmul.shape_fits(lin.in_features, lin.out_features, NF4_BLOCK)]
    if in_c:  # (with the adapter's panel where native_lora's adapter is added inside that product)
        adapter_rank = rank if rank and bf16_compute_lora(e, stream_bytes, rank, lora_dropout, on_cpu) else 0
        base["NF4 input-gradient panels (nf4_matmul, per thread)"] = nf4_matmul.scratch_bytes(
            N, max(lin.out_features for lin in in_c), nf4_matmul.team_threads(), adapter_rank,
            any(nf4_matmul.rows_copied(lin.out_features) for lin in in_c))
    # where nf4_amx multiplies NF4 weights on AMX's tiles (bf16 on a CPU with AMX), its threads' sums
    if any(lin.path in quantized and nf4_amx.weight_fits(lin.in_features, lin.out_features, NF4_BLOCK)
           for lin in shape.linears) and bf16_compute_nf4_amx(e, stream_bytes, on_cpu):
        base["NF4 AMX GEMM sums (nf4_amx, per thread)"] = nf4_amx.scratch_bytes(nf4_matmul.team_threads())
    loss_forward, loss_backward = loss_phases(n, V, e, native=bf16_compute_loss(e, stream_bytes, on_cpu))
    loss_kept = sum(saved.head.get(term, 0) for term in LOSS_KEPT)
    phases = {
        "forward (loss)": {**base, "grads (last step's; zero_grad follows the forward)": grads, "activations": A,
                           **loss_forward},
        "backward: loss": {**base, "activations": A, **loss_backward},
        "backward: head": {**base, "activations (what the loss kept freed)": A - loss_kept,
                           **head_gradients(n, C, V, e), "head weight gradient": embedding if full else 0},
    }
    if full:
        per_block = (total_params(shape) - V * C * (1 if shape.tie_embeddings else 2) - shape.n_positions * C
                     - shape.final_norm.params) // shape.n_layer
        so_far = (embedding + per_block * FP32)
    else:
        lins = resolve_targets(shape, targets)
        so_far = sum((rank or 0) * (lin.in_features + lin.out_features) for lin in lins) * grad_bytes
    block = {**base, GRADS_SO_FAR: so_far, "activations (head's freed)": A - head_saved,
             "residual and MLP gradients": block_grads}
    if not full and bf16_gemm_fallback(e, stream_bytes, on_cpu):  # a moment of its own, if it is the larger
        widest = N * max(lin.in_features for lin in lins)  # the LoRA input gradient grad_a·A (N, in), aᵀ-major
        residual = N * C * (stream_bytes or e)
        if residual + widest * (e + FP32) > block_grads:
            del block["residual and MLP gradients"]
            block.update({"residual gradient": residual, "widest LoRA input gradient": widest * e,
                          "its product's fp32 buffer (no bf16 units)": widest * FP32})
    if grad_checkpoint:
        block["recomputed block's saved tensors"] = sum(plain.blocks[-1].values())
        # inside the last block's forward: what it would save is alive until it returns
        phases["forward: last block"] = {**base, "grads (last step's)": grads,
                                         "activations (before the head)": A - head_saved,
                                         "block's tensors during its forward": sum(plain.blocks[-1].values())}
    phases["backward: last block"] = block
    if plain.math_attention is not None:
        phases.update(math_attention_phases(plain.math_attention, base, grads, so_far, A - head_saved,
                                            N * C * (stream_bytes or e), sum(plain.blocks[-1].values())
                                            if grad_checkpoint else None))
        if grad_checkpoint:  # the block's forward makes all three (B, h, T, T) tensors, kept or not
            phases["forward: last block"]["attention probabilities, noise, dropped copy not kept"] = \
                (3 - plain.math_attention.kept) * plain.math_attention.scores
    if full:
        ids = sum(v for k, v in saved.embed.items() if "ids" in k)
        phases["backward: embeddings"] = {**base, "grads": grads, "activations (ids)": ids,
                                          "embedding gradient temporaries":
                                              embedding if shape.tie_embeddings else 0}
    phases["optimizer step"] = {**base, "grads": grads}  # fused AdamW: in place, no temporaries
    kept = kept_logits(n, V, e, stream_bytes, on_cpu, grad_checkpoint)
    if kept:  # held from one step to the next; the loss's and the head's phases count them as the logits
        for name, terms in phases.items():
            if name not in ("forward (loss)", "backward: loss", "backward: head"):
                terms["logits kept for the next step (keep_head_output)"] = kept
    return phases


def accumulating(phases: dict[str, dict[str, int]], grads: int, embedding: int) -> dict[str, dict[str, int]]:
    """The phases of a step that adds up the gradients of several micro-batches (gradient accumulation).

    Every micro-batch's forward already runs beside a full set of gradients (the last step's before the first
    zero_grad, the step's own after it), as one batch's does. Every backward after the first runs with the step's
    gradients so far alive: each new gradient is added into its parameter's .grad and freed, so those backward
    phases hold all of G in place of the grads a single batch's backward has made so far; at the embeddings (full
    fine-tuning) the new embedding gradient, `embedding` bytes, is alive beside the one .grad holds."""
    out = {}
    for name, terms in phases.items():
        if name == "backward: embeddings":  # holds G already
            terms = {**terms, "the new embedding gradient, before it is added": embedding}
        elif name.startswith("backward"):
            terms = {**{k: v for k, v in terms.items() if k != GRADS_SO_FAR},
                     "grads (the earlier micro-batches', added into)": grads}
        out[name] = terms
    return out


def math_attention_phases(att: MathAttention, base: dict[str, int], grads: int, so_far: int, before_head: int,
                          residual: int, recomputed: int | None) -> dict[str, dict[str, int]]:
    """The moments of the last block's attention on SDPA's math path (the model's dropout) that can be a step's
    peak: its forward, while the probabilities, their noise and the dropped copy exist (kept or not); its backward
    at the dropout, where the dropped copy is freed and the gradients of the dropped and the plain probabilities
    exist (at the product with v when q and k need no grad). before_head: the activations but what the head saved;
    residual: the residual stream's gradient; recomputed: the block's saved tensors, recomputed in backward under
    checkpointing (None without)."""
    backward = before_head + (recomputed or 0) - att.after  # what the block saved after its attention is freed by then
    if att.qk_hot:
        backward_terms = {"activations (the head's, the block's after its attention and the dropped copy freed)":
                              backward - (att.scores if att.v_hot else 0),
                          "gradients of the dropped and the plain probabilities (h x T x T)": 2 * att.scores}
    else:
        backward_terms = {"activations (the head's and the block's after its attention freed)": backward}
    phases = {"backward: last block's attention": {
        **base, GRADS_SO_FAR: so_far, **backward_terms, "residual gradient": residual,
        "v's gradient": att.v_grad if att.v_hot else 0}}
    if recomputed is None:  # without checkpointing; with it, "forward: last block" holds the block's forward
        phases["forward: last block's attention"] = {
            **base, "grads (last step's; zero_grad follows the forward)": grads,
            "activations (before the block's attention)": before_head - att.after - att.kept * att.scores,
            "attention probabilities, noise, dropped copy (h x T x T)": 3 * att.scores}
    return phases


PhaseModel = Callable[..., dict[str, dict[str, int]]]
PEAK_MODELS: dict[str, PhaseModel] = {"minigpt": minigpt_phases, "gpt2": minigpt_phases, "llama": llama_phases,
                                      "mistral": llama_phases, "qwen2": llama_phases}


def has_peak_model(shape: ModelShape) -> bool:
    return shape.family in PEAK_MODELS


def step_peak(shape: ModelShape, regime: str, rank: int | None = None, targets: str | Iterable[str] = ALL_LINEAR,
              batch_size: int = 16, seq_len: int = 32, act_bytes: int = 4, grad_checkpoint: bool = False, *,
              weights: int, grads: int, optimizer: int, grad_bytes: int = 4, stream_bytes: int | None = None,
              lora_copy_bytes: int = 0, on_cpu: bool = True, upcast: Collection[str] = (),
              counted: int | None = None, dropout: float = 0.0, lora_dropout: float = 0.0,
              grad_accum: int = 1) -> Peak:
    """The phase where a training step peaks and what is alive there (``PEAK_MODELS[shape.family]``).

    act_bytes, stream_bytes and lora_copy_bytes are the exact activation model's widths (e, s, c of
    planner/activations.py); ``PRECISION_WIDTHS[precision]`` holds them for an fp32 or a bf16 run. on_cpu False:
    a CUDA run, whose attention is SDPA's (planner/activations.py's bf16_compute_attention). upcast: the paths of
    a 16-bit base's block Linears upcast per product into the dequantization workspace under fp32 compute. counted:
    the positions of the batch whose target counts (an instruction batch's answers; None: every position). dropout:
    the model's (MiniGPT and GPT-2: GPTConfig.dropout, on a CPU); lora_dropout: LoRA's (LoRAConfig.dropout).
    grad_accum: micro-batches of batch_size per step (``accumulating``); counted is per micro-batch."""
    phases = PEAK_MODELS[shape.family](shape, regime, rank, targets, batch_size, seq_len, act_bytes, grad_checkpoint,
                                       weights, grads, optimizer, grad_bytes, stream_bytes=stream_bytes,
                                       lora_copy_bytes=lora_copy_bytes, on_cpu=on_cpu, upcast=upcast,
                                       counted=counted, dropout=dropout, lora_dropout=lora_dropout)
    if grad_accum > 1:
        phases = accumulating(phases, grads, shape.vocab_size * shape.d_model * FP32)
    worst = max(phases, key=lambda k: sum(phases[k].values()))
    return Peak(worst, phases)

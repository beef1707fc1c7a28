"""MiniGPT: a small pre-LayerNorm GPT whose module names are a contract.

Each block holds exactly ``attn.q_proj``, ``attn.k_proj``, ``attn.v_proj``, ``attn.o_proj`` and
``mlp.fc1``, ``mlp.fc2``: LoRA targets, adapter keys and the planner are built from these names.

Gradient checkpointing is a switch on the model, not a config field (it changes memory, never the
result, and a base folder's config.json stays the same): ``model.grad_checkpoint = True`` runs each
block under ``torch.utils.checkpoint`` (non-reentrant) while training, so the forward keeps only each
block's input and the backward recomputes the block before differentiating it.

Attention is ``F.scaled_dot_product_attention`` (causal), except in bf16 on CPU with as many keys as queries (no
KV cache before them) and no attention dropout, where ``minigpt.native_attention`` computes the same with bf16
GEMMs around a C softmax (faster there; on a CPU with bf16 units, AVX512-BF16 or AMX, a block of queries at a
time in one C call, ``minigpt.fused_attention``). In bf16 on CPU GPT-2's tanh GELU runs in C, and the exact GELU's
gradient (``minigpt.native_gelu``). Where ``mlp.fc2`` says it takes GELU's input (``takes_gelu_input``: minituner's
LoRALinear) the MLP hands it fc1's output and the GELU form (``fc2(h, gelu=...)``), and fc2 applies GELU itself,
its gradient fused into fc2's own; the same values as GELU then fc2.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import native_attention, native_gelu
from .errors import InputError, check_config_values, check_known_fields
from .kv_cache import KVCache, LayerKV, attention_mask
from .residual import add_pending, add_then_norm, in_halves
from .sampling import generate

ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}  # name -> F.gelu(approximate=...)


@dataclass
class GPTConfig:
    vocab_size: int = 128  # read from tokenizer.json in practice
    block_size: int = 128  # longest context, = number of learned positions
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    d_ff: int = 0  # MLP hidden width; 0 means 4 * d_model
    dropout: float = 0.0
    bias: bool = True  # biases in every Linear and LayerNorm
    tie_weights: bool = True  # lm_head shares the token embedding
    activation: str = "gelu"  # "gelu" (exact) or "gelu_tanh" (GPT-2's approximation)
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model
        self.validate()

    def validate(self) -> None:
        """Raise InputError naming the first field that cannot build a model."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise InputError(f"n_head={self.n_head} does not divide d_model={self.d_model}")
        check_config_values(self, fractions=("dropout",), positive=("layer_norm_eps",), flags=("bias", "tie_weights"),
                            choices={"activation": ACTIVATIONS})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        check_known_fields(cls, d)
        missing = sorted({"vocab_size", "block_size"} - set(d))
        if missing:
            raise InputError(f"GPTConfig is missing required fields {missing}")
        return cls(**d)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, h, T, hs)
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        start = 0
        if kv is not None:  # generation: the tokens before these are stored (minigpt.kv_cache)
            start = kv.cache.length
            k, v = kv.update(k, v)  # (B, h, start + T, hs)
        p = self.dropout if self.training else 0.0
        if start == 0 and p == 0.0 and native_attention.fits(q, k, v):  # bf16 on CPU: bf16 GEMMs + C softmax
            y = native_attention.causal_attention(q, k, v)  # (B, h, T, hs), laid out (B, T, h, hs)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, h, T, hs)
        else:  # causal from position `start` (None for one new token: it sees every stored key)
            mask = attention_mask(T, start, None, x.device)  # (T, start + T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, h, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.approximate = ACTIVATIONS[cfg.activation]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, T, d_ff)
        if getattr(self.fc2, "takes_gelu_input", False):  # a LoRA layer (minituner.lora): GELU applied inside it,
            return self.drop(self.fc2(h, gelu=self.approximate))  # its gradient fused into fc2's input gradient
        h = native_gelu.gelu(h, self.approximate)  # bf16 on CPU: C for the tanh form, the exact one's gradient
        return self.drop(self.fc2(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x, out = self.halves(x, None, kv)
        return x + out  # (B, T, C)

    def halves(self, x: torch.Tensor, branch: torch.Tensor | None, kv: LayerKV | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attn(ln_1(x)), mlp(ln_2 of that)): the block without its last residual add, which the caller joins
        to the next norm; branch: the block before's such output, added into x here by ln_1 (minigpt.residual)."""
        x, h = add_then_norm(x, branch, self.ln_1)
        x, h = add_then_norm(x, self.attn(h, kv), self.ln_2)  # x + attn(ln_1(x)), ln_2 of it (B, T, C)
        return x, self.mlp(h)


class MiniGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.grad_checkpoint = False  # recompute each block in backward (training only); no state, no new module
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("o_proj.weight", "fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def new_kv_cache(self, capacity: int) -> KVCache:
        """An empty key/value cache for up to `capacity` positions (generation; minigpt.kv_cache)."""
        return KVCache(self.config.n_layer, capacity)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size); with `cache`, idx continues the positions it holds; with
        `keep` (B, T) bool, logits (n, vocab_size) of the n kept positions only, in order (``head_rows``)."""
        B, T = idx.shape
        start = cache.check_room(B, T) if cache is not None else 0
        if start + T > self.config.block_size:
            raise InputError(f"sequence length {start + T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled() and cache is None
        branch = None  # the last block's MLP output, its residual add left to the next norm (minigpt.residual)
        for i, block in enumerate(self.blocks):
            kv = cache.layers[i] if cache is not None else None
            if recompute or not in_halves(block):
                x, branch = add_pending(x, branch), None
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x, kv)  # (B, T, C)
            else:
                x, branch = block.halves(x, branch, kv)
        if cache is not None:
            cache.advance(T)
        _, h = add_then_norm(x, branch, self.ln_f)
        return self.lm_head(head_rows(h, keep))  # (B, T, V), or (n, V) with keep

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, eos_id: int | list[int] | None = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Sample continuations of idx (B, T), stopping once every row has sampled an eos_id (minigpt.sampling)."""
        return generate(self, idx, max_new_tokens, temperature, top_k, generator, eos_id, use_cache)


def head_rows(h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The final hidden states (B, T, C) the head multiplies: all, or with `keep` (B, T) bool only the kept
    rows, (n, C). A loss whose targets mostly do not count (an instruction set's prompts and padding) then
    skips their share of the head's product, the largest in a small model with a large vocabulary, and of the
    (N, V) logits held for backward: the others' loss gradient is zero, so nothing else changes."""
    if keep is None:
        return h
    if keep.dtype != torch.bool or keep.shape != h.shape[:-1]:
        raise ValueError(f"keep must be a bool mask of shape {tuple(h.shape[:-1])}, got {keep.dtype} "
                         f"{tuple(keep.shape)}")
    return h[keep]


def block_list(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks a model runs in order: MiniGPT's ``blocks`` (GPT-2 included), the Decoder's
    ``model.layers``; none for any other module."""
    blocks = getattr(model, "blocks", None) or getattr(getattr(model, "model", None), "layers", None) or []
    return list(blocks)

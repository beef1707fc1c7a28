"""One decoder for the llama, mistral and qwen2 families (and GPT-style variants), set by a dataclass.

The families differ in data, not in code (litgpt's single GPT + Config is the model for this):
RMSNorm or LayerNorm, rotary (RoPE, with Llama 3's frequency scaling) or learned positions, SwiGLU or
GELU MLP, grouped-query attention, optional biases, tied or untied head, an explicit head_dim, and a
sliding-window mask on chosen layers (Mistral: all, Qwen2: from max_window_layers on).

Module names are Hugging Face's, so state-dict keys equal the checkpoint's and LoRA targets / PEFT keys
are the ones users know: ``model.embed_tokens``, ``model.layers.N.input_layernorm``,
``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.post_attention_layernorm``,
``model.layers.N.mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``.
Reading a config.json into a DecoderConfig lives in ``minituner.hf_config``; this file imports nothing
from minituner.

Gradient checkpointing is a switch on the model, as on MiniGPT (it changes memory, never the result; no
config field, no module, no state-dict key): ``model.grad_checkpoint = True`` runs each layer under
``torch.utils.checkpoint`` (non-reentrant) while training with grad enabled, so the forward keeps only each
layer's input (and the rotary cos/sin it is called with) and the backward recomputes the layer.

Generation passes a ``minigpt.kv_cache.KVCache`` (``model(ids, cache=cache)``): each layer stores its keys
and values (after RoPE, at their num_key_value_heads), and the next call's tokens continue at the positions stored.

Attention in bf16 on CPU (as many keys as queries: training, plain forwards and generation's first call; no
attention dropout; up to 1,024 tokens) is ``minigpt.native_attention``: bf16 GEMMs around a C softmax, each K/V head's query heads stacked as rows, so k
and v stay at their kv heads there too (on a CPU with bf16 units, AVX512-BF16 or AMX, heads whose width is a
multiple of 32 attend in one C call, ``minigpt.fused_attention``, each query head reading its K/V head where it
lies). Otherwise:
grouped-query attention on CPU hands the kv heads to ``F.scaled_dot_product_attention(..., enable_gqa=True)``
where PyTorch's fused CPU kernel takes them (``cpu_flash_takes_gqa``, asked once: torch 2.9 on): the kernel
reads each K/V head for its group of query heads, so k and v are never repeated to n_head heads (on a 2-core
CPU at Llama-3.2-1B's shape, 39 against 43 ms for one layer's attention forward and backward, and the saved k
and v are n_head / n_kv_head times smaller). Elsewhere, and on CUDA (whose memory-efficient kernel does not
take enable_gqa, so SDPA would fall back to its h·T² math path), k and v are repeated first.

RoPE in bf16 on CPU (heads whose width is a multiple of 32) is ``minigpt.native_rope``: q and k rotated in one C
call each way, the bits of ``apply_rope``'s PyTorch ops, which run everywhere else.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import native_attention, native_gelu, native_rope, native_swiglu
from .errors import InputError, check_config_values, check_known_fields
from .kv_cache import KVCache, LayerKV, attention_mask
from .model import head_rows
from .residual import add_pending, add_then_norm, in_halves
from .sampling import generate


def _ask_cpu_flash_for_gqa() -> bool:
    """One tiny SDPA call with grouped K/V heads and a graph: did the fused flash kernel take it? False on torch
    before 2.5 (no enable_gqa) and where the call would take the math path instead."""
    with torch.inference_mode(False), torch.enable_grad():
        q = torch.zeros(1, 2, 2, 8, requires_grad=True)
        kv = torch.zeros(1, 1, 2, 8)
        try:
            y = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):
            return False
        return "flash" in type(y.grad_fn).__name__.lower()


# asked at import, outside any model call: inside one (a checkpointed layer, no_grad) the question's own graph
# would count among the layer's saved tensors, or there would be no graph to look at
_CPU_FLASH_GQA = _ask_cpu_flash_for_gqa()


def cpu_flash_takes_gqa() -> bool:
    """Whether SDPA on CPU runs grouped K/V heads (enable_gqa=True) through its fused flash kernel (torch 2.9 on)."""
    return _CPU_FLASH_GQA


NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
MLPS = ("swiglu", "gelu")
ACTIVATIONS = {  # hidden_act -> function
    "silu": F.silu,
    "gelu": native_gelu.exact_gelu,  # its gradient in C for bf16 on CPU (minigpt.native_gelu), else F.gelu's
    "gelu_pytorch_tanh": native_gelu.tanh_gelu,  # in C for bf16 on CPU (minigpt.native_gelu), else F.gelu
    "gelu_new": native_gelu.tanh_gelu,
}
ROPE_TYPES = ("default", "llama3")


@dataclass
class DecoderConfig:
    model_type: str = "llama"  # the Hugging Face family ("llama", "mistral", "qwen2"); names the export class
    vocab_size: int = 128  # rows of the token embedding and of the output head
    block_size: int = 128  # longest context (max_position_embeddings)
    n_layer: int = 2  # num_hidden_layers
    n_head: int = 4  # num_attention_heads (query heads)
    n_kv_head: int = 4  # num_key_value_heads; < n_head is grouped-query attention
    d_model: int = 64  # hidden_size
    head_dim: int = 0  # width of one head; 0 means d_model // n_head
    d_ff: int = 0  # intermediate_size (MLP hidden width); 0 means 4 * d_model
    norm: str = "rmsnorm"  # "rmsnorm" or "layernorm"
    norm_eps: float = 1e-6  # rms_norm_eps / layer_norm_eps
    norm_bias: bool = False  # LayerNorm only: a bias beside the weight
    positions: str = "rope"  # "rope" (no parameters) or "learned" (model.embed_positions)
    rope_theta: float = 10000.0  # RoPE base
    rope_type: str = "default"  # "default" or "llama3" (Llama 3.1's frequency-dependent scaling)
    rope_factor: float = 8.0  # llama3: how much the context was stretched
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are divided by factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    rope_original_max_position_embeddings: int = 8192  # llama3: the pre-training context
    mlp: str = "swiglu"  # "swiglu" (down(act(gate(x)) * up(x))) or "gelu" (down(act(up(x))))
    activation: str = "silu"  # hidden_act; a key of ACTIVATIONS
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (qwen2; llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (llama's attention_bias)
    mlp_bias: bool = False  # biases on the MLP's Linears (llama's mlp_bias)
    tie_word_embeddings: bool = False  # lm_head shares model.embed_tokens' weight
    sliding_window: int | None = None  # tokens a query sees (itself included) on sliding layers; None: all
    sliding_layers: list[int] = field(default_factory=list)  # indices of the layers that use the window
    attention_dropout: float = 0.0  # dropout on attention probabilities while training

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.n_head:
            self.head_dim = self.d_model // self.n_head
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model
        self.sliding_layers = sorted(int(i) for i in self.sliding_layers)
        self.validate()

    def validate(self) -> None:
        """Raise InputError naming the first field that cannot build a model."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "d_model", "head_dim", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise InputError(f"num_key_value_heads={self.n_kv_head} does not divide num_attention_heads={self.n_head}")
        if self.positions == "rope" and self.head_dim % 2:
            raise InputError(f"head_dim={self.head_dim} must be even for rotary positions")
        check_config_values(self, fractions=("attention_dropout",),
                            positive=("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                                      "rope_high_freq_factor", "rope_original_max_position_embeddings"),
                            flags=("qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings"),
                            choices={"norm": NORMS, "positions": POSITIONS, "mlp": MLPS, "activation": ACTIVATIONS,
                                     "rope_type": ROPE_TYPES})
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise InputError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if any(not 0 <= i < self.n_layer for i in self.sliding_layers):
            raise InputError(f"sliding_layers {self.sliding_layers} name layers outside 0..{self.n_layer - 1}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        check_known_fields(cls, d)
        return cls(**d)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32 on the CPU, Llama 3 scaling applied when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if cfg.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band in
    # between blended linearly in (original context / wavelength).
    old = cfg.rope_original_max_position_embeddings
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x2, x1) over the last dimension's halves (Hugging Face's rotate_half, (-x2, x1), without
    its minus sign: the half-split layout their checkpoints use)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., d) with its first half negated: ``rotate_half(q) * sin == swap_halves(q) * signed_sin(sin)``
    exactly (a sign flip rounds the same), so the minus that every layer would apply to q and k (and to their
    gradients) is applied once, to the (T, d) table."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x (B, heads, T, d): x·cos + rotate_half(x)·sin, the sine given as signed_sin(sin)."""
    return x * cos + swap_halves(x) * sin_signed


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope on q (B, h, T, d) and on k (B, kv, T, d): for bf16 on CPU one C call for both each way
    (``minigpt.native_rope``, the same bits), else PyTorch's ops."""
    if native_rope.fits(q, k, cos, sin_signed):
        return native_rope.rope_qk(q, k, cos, sin_signed)
    return apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as the reference does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def make_norm(cfg: DecoderConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.norm_bias)


class Attention(nn.Module):
    """Causal self-attention with grouped K/V heads, RoPE on q and k, and an optional sliding window."""

    def __init__(self, cfg: DecoderConfig, sliding: bool) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.window = cfg.sliding_window if sliding else None
        self.dropout = cfg.attention_dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv: LayerKV | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        if rope is not None:
            q, k = apply_rope_qk(q, k, *rope)  # rope: cos and sin (T, hd), the sine's first half negated
        start = 0
        if kv is not None:  # generation: the tokens before these are stored (minigpt.kv_cache)
            start = kv.cache.length
            k, v = kv.update(k, v)  # (B, kv, start + T, hd)
        p = self.dropout if self.training else 0.0
        if start == 0 and p == 0.0 and native_attention.fits(q, k, v):  # bf16 on CPU: bf16 GEMMs + C softmax
            y = native_attention.causal_attention(q, k, v, self.window)  # (B, h, T, hd), laid out (B, T, h, hd)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        gqa = {}
        if self.n_kv_head != self.n_head:  # each K/V head serves n_head / n_kv_head query heads
            if x.device.type == "cpu" and cpu_flash_takes_gqa():
                gqa = {"enable_gqa": True}  # the kernel reads k, v (B, kv, start + T, hd) per group
            else:
                rep = self.n_head // self.n_kv_head
                k = k.repeat_interleave(rep, dim=1)  # (B, h, start + T, hd)
                v = v.repeat_interleave(rep, dim=1)  # (B, h, start + T, hd)
        if start == 0 and (self.window is None or T <= self.window):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **gqa)  # (B, h, T, hd)
        else:  # causal from position `start`, at most `window` keys back (self included); None: every key
            mask = attention_mask(T, start, self.window, x.device)  # (T, start + T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **gqa)  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, h*hd)
        return self.o_proj(y)  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)); or a plain two-layer MLP: down(act(up(x)))."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.mlp == "swiglu":
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.silu = cfg.activation == "silu"
        self.gated = cfg.mlp == "swiglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))  # (B, T, C)
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, ff) each
        if native_swiglu.fits(gate, up):  # bf16 on CPU: one pass of C each way (silu), keeping gate and up
            h = native_swiglu.swiglu(gate, up, None if self.silu else self.act)
        else:
            h = self.act(gate) * up  # (B, T, ff)
        return self.down_proj(h)  # (B, T, C)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg, sliding=cfg.sliding_window is not None and index in cfg.sliding_layers)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv: LayerKV | None = None) -> torch.Tensor:
        x, out = self.halves(x, None, rope, kv)
        return x + out  # (B, T, C)

    def halves(self, x: torch.Tensor, branch: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None,
               kv: LayerKV | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attn(norm(x)), mlp(norm of that)): the layer without its last residual add, which the caller joins
        to the next norm; branch: the layer before's such output, added into x here by the first norm
        (minigpt.residual)."""
        x, h = add_then_norm(x, branch, self.input_layernorm)
        x, h = add_then_norm(x, self.self_attn(h, rope, kv), self.post_attention_layernorm)
        return x, self.mlp(h)


class DecoderStack(nn.Module):
    """Hugging Face's ``model``: embeddings, the layers and the final norm."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.embed_positions = nn.Embedding(cfg.block_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layer))
        self.norm = make_norm(cfg)


class Decoder(nn.Module):
    """A causal LM: token ids (B, T) -> logits (B, T, vocab_size), MiniGPT's interface."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # RoPE frequencies: a plain float32 tensor, not a buffer, so no dtype cast of the model touches it.
        self._inv_freq = rope_inv_freq(cfg) if cfg.positions == "rope" else None
        if self._inv_freq is not None and not bool(torch.isfinite(self._inv_freq * cfg.block_size).all()):
            raise InputError(f"rope_theta {cfg.rope_theta!r} makes the rotary angles overflow (inf within "
                             f"{cfg.block_size} positions): nan at every query")
        self.grad_checkpoint = False  # recompute each layer in backward (training only); no state, no new module
        # the dtype q and k are in when RoPE meets them (None: the stream's); bf16 compute sets it
        # (minituner.precision), so cos and sin are made once in fp32 and rounded to it once
        self.compute_dtype: torch.dtype | None = None
        self.apply(self._init_weights)  # a no-op on the meta device, where loaders build the model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head again (after a loader assigned new Parameter objects)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def rope(self, T: int, device: torch.device, dtype: torch.dtype, start: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (T, head_dim) of positions start..start+T-1, computed in float32, returned in dtype."""
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        positions = torch.arange(start, start + T, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self._inv_freq[None, :]  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        m = self.model
        x = m.embed_tokens(idx)  # (B, T, C)
        rope = None
        if self.config.positions == "learned":
            x = x + m.embed_positions(torch.arange(start, start + T, device=idx.device))  # (B, T, C)
        else:
            cos, sin = self.rope(T, idx.device, self.compute_dtype or x.dtype, start)
            rope = cos, signed_sin(sin)  # what every layer's apply_rope takes
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled() and cache is None
        branch = None  # the last layer's MLP output, its residual add left to the next norm (minigpt.residual)
        for i, layer in enumerate(m.layers):
            kv = cache.layers[i] if cache is not None else None
            if recompute or not in_halves(layer):
                x, branch = add_pending(x, branch), None
                x = checkpoint(layer, x, rope, use_reentrant=False) if recompute else layer(x, rope, kv)  # (B, T, C)
            else:
                x, branch = layer.halves(x, branch, rope, kv)
        if cache is not None:
            cache.advance(T)
        _, h = add_then_norm(x, branch, m.norm)
        return self.lm_head(head_rows(h, keep))  # (B, T, V), or (n, V) with keep

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, eos_id: int | list[int] | None = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Sample continuations of idx (B, T), stopping once every row has sampled an eos_id (minigpt.sampling)."""
        return generate(self, idx, max_new_tokens, temperature, top_k, generator, eos_id, use_cache)

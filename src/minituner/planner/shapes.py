"""Shape descriptions: everything the planner needs to know about a model, and nothing else.

A ``ModelShape`` lists one transformer block's Linears and norms (by the path the family gives them
inside a block, e.g. ``attn.q_proj`` or ``mlp.c_proj``), the embeddings, the final norm and whether the
output head is tied to the token embedding. Counting is then plain arithmetic: no model is built.
MiniGPT shapes come from a ``GPTConfig``; Hugging Face families are in ``hf.py``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from minigpt.errors import InputError
from minigpt.model import GPTConfig

ATTENTION, MLP = "attention", "mlp"


@dataclass(frozen=True)
class LinearShape:
    path: str  # path inside one block, e.g. "attn.q_proj"; its last part is the PEFT target name
    kind: str  # ATTENTION or MLP
    in_features: int
    out_features: int
    bias: bool  # a bias vector of out_features (frozen, never LoRA-ed)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def bias_params(self) -> int:
        return self.out_features if self.bias else 0


@dataclass(frozen=True)
class NormShape:
    path: str  # "ln_1", "input_layernorm", "ln_f", "norm" ...
    size: int
    bias: bool  # LayerNorm with a bias has 2 * size parameters; RMSNorm has size

    @property
    def params(self) -> int:
        return self.size * (2 if self.bias else 1)


@dataclass(frozen=True)
class ModelShape:
    family: str  # "minigpt", "gpt2", "llama", "mistral", "qwen2"
    name: str  # preset name or config path, for display
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int  # key/value heads (GQA); = n_head without GQA
    head_dim: int
    d_ff: int  # MLP hidden width
    n_positions: int  # rows of a learned position embedding; 0 for rotary (no parameters)
    tie_embeddings: bool  # output head shares the token embedding (counted once)
    linears: tuple[LinearShape, ...]  # one block's Linears, in module order
    norms: tuple[NormShape, ...]  # one block's norms
    final_norm: NormShape
    sliding_window: int | None = None  # keys a query sees on sliding layers (Mistral, Qwen2); None: all
    sliding_layers: tuple[int, ...] = ()  # the layers that use the window

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if not isinstance(self.n_positions, int) or self.n_positions < 0:
            raise InputError(f"{self.name}: n_positions must be a non-negative integer, got {self.n_positions!r}")
        if not self.linears:
            raise InputError(f"{self.name}: a block must hold at least one Linear")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["linears"] = [asdict(lin) for lin in self.linears]
        d["norms"] = [asdict(n) for n in self.norms]
        if self.sliding_window is None:  # only where a family has one: the JSON of other shapes is unchanged
            del d["sliding_window"], d["sliding_layers"]
        else:
            d["sliding_layers"] = list(self.sliding_layers)
        return d


def minigpt_shape(cfg: GPTConfig, name: str = "minigpt") -> ModelShape:
    """The shape of ``MiniGPT(cfg)``: four d x d attention projections, fc1/fc2, two LayerNorms per block."""
    cfg.validate()
    d, ff, b = cfg.d_model, cfg.d_ff, cfg.bias
    linears = tuple(LinearShape(f"attn.{p}", ATTENTION, d, d, b) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    linears += (LinearShape("mlp.fc1", MLP, d, ff, b), LinearShape("mlp.fc2", MLP, ff, d, b))
    return ModelShape(
        family="minigpt", name=name, vocab_size=cfg.vocab_size, d_model=d, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_kv_head=cfg.n_head, head_dim=d // cfg.n_head, d_ff=ff,
        n_positions=cfg.block_size, tie_embeddings=cfg.tie_weights, linears=linears,
        norms=(NormShape("ln_1", d, b), NormShape("ln_2", d, b)), final_norm=NormShape("ln_f", d, b),
    )

"""Load any base model minituner can fine-tune, chosen by ``model_type`` in the folder's config.json.

    model, tokenizer = load_base("artifacts/base")              # MiniGPT, GPT-2, Llama, Mistral or Qwen2
    model, tokenizer = load_base("models/llama", quantize=("all-linear", "nf4_per_group_64"))  # QLoRA

minigpt and gpt2 folders load as ``MiniGPT``; llama, mistral and qwen2 folders as ``Decoder``
(``hf_load.load_hf_decoder``: tensor by tensor, each quantized as it is read when ``quantize`` selects it,
so a QLoRA base is never in memory at full precision). ``dtype`` None keeps the checkpoint's dtype (a bf16
checkpoint stays bf16). A Hugging Face tokenizer carries ``eos_ids`` from generation_config/config.json.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.base_folder import CONFIG, WEIGHTS, WEIGHTS_INDEX, load_minigpt_folder
from minigpt.decoder import DecoderConfig
from minigpt.errors import InputError
from minigpt.io import read_json, sha256_file
from minigpt.model import GPTConfig

from .hf_config import ROTARY_FAMILIES, decoder_config_from_hf, eos_token_ids
from .hf_gpt2 import config_from_gpt2, load_gpt2
from .hf_load import (QuantizeSpec, checkpoint_files, load_hf_decoder, load_hf_tokenizer, quantized_paths,
                      read_headers)
from .memory.stored_dtypes import stored_dtypes
from .precision import dtype_of_most_values
from .qlora import quantize_linears
from .tokenizer_files import HFTokenizer, Tokenizer, load_tokenizer  # noqa: F401  (re-exported)

KINDS = {
    "minigpt": "a minituner base folder (written by `minituner pretrain`)",
    "gpt2": "a Hugging Face GPT-2 folder (config.json + model.safetensors)",
    **{f: f"a Hugging Face {f} folder (config.json + model.safetensors or a sharded index)" for f in ROTARY_FAMILIES},
}
DEFAULT_SEQ_LEN = 512  # training window of a Hugging Face base unless --seq-len says otherwise


def base_kind(folder: str | Path) -> str:
    """model_type of a base folder (minigpt when the config has none); an InputError for anything else."""
    folder = Path(folder)
    valid = "; ".join(f"{k}: {v}" for k, v in KINDS.items())
    if not folder.is_dir():
        raise InputError(f"{folder}: no such model folder (valid: {valid})")
    if not (folder / CONFIG).is_file():
        raise InputError(f"{folder}: not a model folder, no {CONFIG} (valid: {valid})")
    config = read_json(folder / CONFIG)
    if "model_type" not in config and ("architectures" in config or "hidden_size" in config):
        raise InputError(f"{folder}/{CONFIG}: a Hugging Face config without model_type; add the one its family uses "
                         f"({', '.join(k for k in KINDS if k != 'minigpt')})")
    kind = config.get("model_type", "minigpt")
    if not isinstance(kind, str) or kind not in KINDS:
        raise InputError(f"{folder}/{CONFIG}: model_type {kind!r} is not supported; valid: {', '.join(KINDS)}")
    return kind


def load_base(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              quantize: QuantizeSpec | None = None) -> tuple[nn.Module, Tokenizer | None]:
    """A base folder -> (model in eval mode, tokenizer or None).

    dtype: None keeps the checkpoint's float dtype, else every float tensor is read as it. quantize: a
    predicate over Linear paths or (targets, scheme); those Linears become QuantizedLinear (while reading for
    Hugging Face decoders; after the load for MiniGPT and GPT-2, whose checkpoints are small).
    """
    folder = Path(folder)
    kind = base_kind(folder)
    if kind in ROTARY_FAMILIES:
        model = load_hf_decoder(folder, device, dtype, quantize)
        return model, load_hf_tokenizer(folder, model.config.vocab_size)
    if kind == "minigpt":
        model, tokenizer = load_minigpt_folder(folder, device)
    else:
        model = load_gpt2(folder, device)
        tokenizer = load_hf_tokenizer(folder, model.config.vocab_size)
    if dtype is not None:
        model.to(dtype)
    paths, scheme = quantized_paths(model, quantize)
    quantize_linears(model, paths, scheme)
    return model, tokenizer


def stored_dtype(folder: str | Path) -> torch.dtype:
    """The float dtype load_base keeps a base folder's weights in, from the tensor headers alone: for a llama,
    mistral or qwen2 folder the dtype holding the most values (a bf16 checkpoint: bfloat16); MiniGPT and GPT-2
    folders load in float32 whatever they store."""
    folder = Path(folder)
    if base_kind(folder) not in ROTARY_FAMILIES:
        return torch.float32
    return dtype_of_most_values((info.dtype, math.prod(info.shape)) for info in _loaded_headers(folder).values())


def _loaded_headers(folder: Path) -> dict:
    """Name -> header of every tensor load_base keeps from a llama-family folder: a tied config's stored
    lm_head.weight is not one (the loader checks it equals the embedding and keeps the embedding alone)."""
    infos = read_headers(checkpoint_files(folder))
    if decoder_config_from_hf(read_json(folder / CONFIG), str(folder / CONFIG)).tie_word_embeddings:
        infos.pop("lm_head.weight", None)
    return infos


def stored_part_dtypes(folder: str | Path) -> dict[str, torch.dtype]:
    """The float dtype of each planner part of a base folder's weights (``memory.stored_dtypes``), from the tensor
    headers alone: what load_base keeps for a llama, mistral or qwen2 folder; empty (every part float32) for
    MiniGPT and GPT-2 folders, which load in float32 whatever they store."""
    folder = Path(folder)
    if base_kind(folder) not in ROTARY_FAMILIES:
        return {}
    return stored_dtypes((name, info.dtype, math.prod(info.shape)) for name, info in _loaded_headers(folder).items())


def model_config(path: str | Path) -> GPTConfig | DecoderConfig:
    """A config.json (or the folder holding one) -> the config of the model finetune would build from it: a
    GPTConfig (MiniGPT, GPT-2) or a DecoderConfig (llama, mistral, qwen2), with every check the loaders make."""
    path = Path(path)
    path = path / CONFIG if path.is_dir() else path
    d = read_json(path)
    kind = d.get("model_type", "minigpt")
    if kind == "gpt2":
        return config_from_gpt2(d, str(path))
    if kind in ROTARY_FAMILIES:
        return decoder_config_from_hf(d, str(path))
    if kind != "minigpt":
        raise InputError(f"{path}: model_type {kind!r} is not supported; valid: {', '.join(KINDS)}")
    try:
        return GPTConfig.from_dict({k: v for k, v in d.items() if k != "model_type"})
    except TypeError as e:
        raise InputError(f"{path}: {e}") from None


def base_config(folder: str | Path) -> GPTConfig | DecoderConfig:
    """The config a base folder's model is built from, read from its config.json alone (no weights)."""
    base_kind(folder)  # a folder holding a config.json of a supported model_type
    return model_config(folder)


def base_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer beside a base folder's model, read without its weights; an InputError when there is none."""
    tokenizer, reason = load_tokenizer(folder, base_config(folder).vocab_size)
    if tokenizer is None:
        raise InputError(reason)
    if isinstance(tokenizer, HFTokenizer):  # as load_hf_tokenizer reads it: the eos ids of generation_config
        tokenizer.eos_ids = eos_token_ids(folder)
    return tokenizer


def default_seq_len(folder: str | Path) -> int:
    """The training window: a MiniGPT base's block size; the smaller of the context and 512 for Hugging Face bases."""
    context = base_config(folder).block_size
    return context if base_kind(folder) == "minigpt" else min(context, DEFAULT_SEQ_LEN)


def base_weights_file(folder: str | Path) -> Path:
    """The file naming a base's weights: model.safetensors, or the index of a sharded checkpoint."""
    folder = Path(folder)
    single = folder / WEIGHTS
    return single if single.is_file() else folder / WEIGHTS_INDEX


def base_weights_sha256(folder: str | Path) -> tuple[str, int]:
    """(sha256, bytes) of a base's weights: the file's for model.safetensors; for a sharded checkpoint the
    sha256 of ``sha256sum``'s lines over the shards (name order), so every shard's bytes count."""
    files = checkpoint_files(Path(folder))
    if len(files) == 1 and files[0].name == WEIGHTS:
        return sha256_file(files[0]), files[0].stat().st_size
    lines = "".join(f"{sha256_file(f)}  {f.name}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest(), sum(f.stat().st_size for f in files)


FINITE_CHUNK = 1 << 24  # values checked at once by check_weights_finite (a 16 MiB bool mask at most)


def check_weights_finite(model: nn.Module, folder: str | Path) -> None:
    """InputError naming the first weight of `model` (loaded from `folder`, with any adapter) that holds nan or inf.
    Generation cannot be trusted to show one: PyTorch's CPU attention gives zeros for a query of nan, so a nan in a
    q_proj weight yields finite logits (one read of every floating-point weight, in chunks)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        for i in range(0, flat.numel(), FINITE_CHUNK):
            if not bool(torch.isfinite(flat[i:i + FINITE_CHUNK]).all()):
                raise InputError(f"{folder}: {name} holds nan or inf (a damaged checkpoint or adapter)")

"""Load a local Hugging Face llama / mistral / qwen2 folder into a Decoder, tensor by tensor.

The folder holds ``config.json``, ``model.safetensors`` or a sharded ``model.safetensors.index.json``,
optionally ``tokenizer.json`` and ``generation_config.json``. No hub access, no ``transformers`` import.

1. Every file's header is read first (safetensors' ``safe_open``, memory mapped): missing shards,
   missing or unexpected tensors and shapes that do not fit the config are refused before any weight
   is read, each with one line naming the tensor (and both shapes) or the file.
2. The model is built on the meta device (no memory, no random init); each tensor is then read,
   converted (``dtype=None`` keeps the checkpoint's: a bf16 checkpoint stays bf16) and assigned. The
   file is opened per tensor, and every kept tensor is copied into memory of its own: safetensors
   (0.8 at least) hands out tensors that are views of its file mapping, which would keep the checkpoint mapped
   for the model's lifetime (a model whose resident size grows as pages are first touched, and whose
   weights change if the file is rewritten in place). A tensor quantized as it is read is not copied.
3. With ``quantize``, each selected Linear is a QuantizedLinear (NF4 by default) from the start and
   its weight is quantized as it is read, so the full-precision model is never in memory at once: the
   peak is the quantized model plus one tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Union

import torch
import torch.nn as nn

from minigpt.base_folder import CONFIG, WEIGHTS, WEIGHTS_INDEX as INDEX
from minigpt.decoder import Decoder, DecoderConfig
from minigpt.errors import InputError
from minigpt.io import read_json
from miniquant import DEFAULT_QUANT_SCHEME, QuantizedLinear
from miniquant.errors import QuantizationError

from .hf_config import eos_token_ids, read_decoder_config
from .lora import find_targets, linear_candidates
from .qlora import check_scheme
from .tokenizer_files import HFTokenizer, load_tokenizer

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older checkpoints saved; recomputed from the config
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
# A predicate over Linear paths, or (LoRA-style targets, scheme) such as ("all-linear", "nf4_per_group_64").
QuantizeSpec = Union[Callable[[str], bool], tuple]


class TensorInfo:
    __slots__ = ("file", "shape", "dtype")

    def __init__(self, file: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.file, self.shape, self.dtype = file, shape, dtype


def _open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a damaged file is the user's input
        raise InputError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def checkpoint_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names (each checked to exist)."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{folder / INDEX}: no weight_map")
        files = []
        for name in sorted(set(weight_map.values())):
            if not isinstance(name, str) or Path(name).name != name:
                raise InputError(f"{folder / INDEX}: shard name {name!r} is not a file in this folder")
            if not (folder / name).is_file():
                raise InputError(f"{folder / INDEX}: shard {name} is missing from {folder}")
            files.append(folder / name)
        return files
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {others[:3]}: re-save with save_pretrained(..., safe_serialization=True))" if others else ""
    raise InputError(f"{folder}: no {WEIGHTS} or {INDEX}{hint}")


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) of every tensor, from the headers alone; a damaged file is an InputError."""
    out: dict[str, TensorInfo] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                s = f.get_slice(name)
                dtype = DTYPES.get(s.get_dtype())
                if dtype is None:
                    raise InputError(f"{path}: tensor {name} has unsupported dtype {s.get_dtype()}")
                if name in out:
                    raise InputError(f"{path}: tensor {name} is also in {out[name].file.name}")
                out[name] = TensorInfo(path, tuple(s.get_shape()), dtype)
    return out


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, TensorInfo], optional: set[str],
                  folder: Path) -> None:
    """Missing, unexpected, misshapen and non-float tensors, named in one line."""
    def names(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f", ... {len(keys) - 4} more" if len(keys) > 4 else "")

    present = {k for k in found if not k.endswith(IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - present - optional)
    unexpected = sorted(present - set(expected))
    if missing:
        raise InputError(f"{folder}: checkpoint is missing tensors the config implies: {names(missing)}")
    if unexpected:
        raise InputError(f"{folder}: checkpoint holds tensors the config has no place for: {names(unexpected)}")
    for k, shape in expected.items():
        if k in found and found[k].shape != shape:
            raise InputError(f"{folder}: tensor {k} has shape {found[k].shape} in "
                             f"{found[k].file.name}, the config implies {shape}")
        if k in found and not found[k].dtype.is_floating_point:
            raise InputError(f"{folder}: tensor {k} is {str(found[k].dtype).removeprefix('torch.')} in "
                             f"{found[k].file.name}; a model's weights are floating point")


def quantized_paths(model: nn.Module, quantize: QuantizeSpec | None) -> tuple[list[str], str]:
    """The Linear paths to quantize and the scheme, from a predicate or (targets, scheme)."""
    if quantize is None:
        return [], DEFAULT_QUANT_SCHEME
    if callable(quantize):
        paths = [p for p, m in linear_candidates(model).items() if type(m) is nn.Linear and quantize(p)]
        return paths, DEFAULT_QUANT_SCHEME
    if isinstance(quantize, tuple) and len(quantize) == 2:
        targets, scheme = quantize
        return find_targets(model, targets), check_scheme(scheme)
    raise InputError(f"quantize must be a predicate over Linear paths or (targets, scheme), got {quantize!r}")


def _quantized_weight(model: nn.Module, key: str) -> bool:
    path, _, name = key.rpartition(".")
    return name == "weight" and isinstance(model.get_submodule(path), QuantizedLinear)


def _set(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    path, _, name = key.rpartition(".")
    module = model.get_submodule(path)
    if isinstance(module, QuantizedLinear):
        if name == "weight":
            module.quantize_weight_(tensor)
        else:
            module.bias.copy_(tensor)
        return
    old = module._parameters.get(name)
    if old is None:
        raise InputError(f"{key}: not a parameter of this model")
    setattr(module, name, nn.Parameter(tensor, requires_grad=old.requires_grad))


def load_hf_decoder(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    quantize: QuantizeSpec | None = None) -> Decoder:
    """A llama / mistral / qwen2 folder -> Decoder in eval mode with transformers' logits.

    dtype None keeps each tensor's checkpoint dtype; quantize selects Linears quantized as they are read
    (a predicate over paths such as ``model.layers.0.mlp.up_proj``, or (targets, scheme)).
    """
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise InputError(f"{folder}: not a model folder (no config.json)")
    if read_json(folder / CONFIG).get("model_type") == "gpt2":
        raise InputError(f"{folder}: model_type 'gpt2' loads as MiniGPT (minituner.hf_gpt2.load_gpt2), not as a Decoder")
    cfg: DecoderConfig = read_decoder_config(folder)
    if dtype is not None and not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating-point dtype, got {dtype}")
    device = torch.device(device)
    found = read_headers(checkpoint_files(folder))
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    check_tensors(expected, found, optional, folder)

    paths, scheme = quantized_paths(model, quantize)
    for p in paths:  # quantized layers exist before any weight is read; each weight fills its buffers
        linear = model.get_submodule(p)
        w = found[f"{p}.weight"]
        layer = QuantizedLinear(linear.in_features, linear.out_features, scheme, linear.bias is not None,
                                dtype or w.dtype, device)
        parent, _, leaf = p.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)

    with torch.no_grad():
        for k in expected:  # model order; each file opened per tensor, so its mapped pages are released at once
            if k not in found or k in optional:
                continue
            with _open(found[k].file) as f:
                try:
                    t = f.get_tensor(k)  # may be a view of the file mapping, alive as long as t is
                except Exception as e:  # noqa: BLE001
                    raise InputError(f"{found[k].file}: cannot read tensor {k} ({str(e).splitlines()[0]})") from None
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # a new tensor
            elif device.type == "cpu" and not _quantized_weight(model, k):
                t = t.clone()  # own memory, not the file's pages (quantized weights are consumed, not kept)
            try:
                _set(model, k, t.to(device))
            except QuantizationError as e:  # NaN or Inf in a weight QLoRA quantizes
                raise InputError(f"{found[k].file}: tensor {k}: {e}") from None
            del t
    model.tie_weights()
    if cfg.tie_word_embeddings and "lm_head.weight" in found:
        _check_stored_head_is_the_embedding(found["model.embed_tokens.weight"], found["lm_head.weight"], folder)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise InputError(f"{folder}: no tensor was read for {left[:4]}")
    return model.eval()


def _check_stored_head_is_the_embedding(embedding: TensorInfo, head: TensorInfo, folder: Path,
                                        rows: int = 4096) -> None:
    """A tied config with an lm_head.weight stored anyway: it must equal the stored embedding, or the checkpoint
    means another model than its config says (transformers would keep the stored head). Both are read from the
    files a few rows at a time, as stored (whatever dtype the model is loaded in)."""
    with _open(embedding.file) as fe, _open(head.file) as fh:
        stored_embedding, stored_head = fe.get_slice("model.embed_tokens.weight"), fh.get_slice("lm_head.weight")
        for start in range(0, head.shape[0], rows):
            e, h = stored_embedding[start:start + rows], stored_head[start:start + rows]
            if e.dtype != h.dtype:  # stored in two float dtypes: compared exactly in float64
                e, h = e.double(), h.double()
            if not torch.equal(e, h):
                raise InputError(f"{folder}: config.json ties the head to the embedding (tie_word_embeddings), but "
                                 f"{head.file.name} holds an lm_head.weight that differs from it")


def load_hf_tokenizer(folder: str | Path, vocab_size: int):
    """The folder's tokenizer.json (None when absent) with ``eos_ids`` from generation_config/config.

    A tokenizer with more tokens than the embedding has rows is an InputError.
    """
    tok, _ = load_tokenizer(folder, vocab_size)
    if isinstance(tok, HFTokenizer):  # a character tokenizer beside the model has no eos of the config's
        tok.eos_ids = eos_token_ids(folder)
    return tok

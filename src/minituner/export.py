"""Merge a LoRA adapter into its base and write a Hugging Face folder transformers and vLLM load.

``export_merged`` leaves the model it is given unchanged: each merged weight is computed on its own
(W + scaling·B·A in float32, an NF4 base dequantized first, as PEFT's merge does), cast to the output
dtype and written, shard by shard, so at most one shard of merged tensors is in memory.

The folder: ``config.json`` (the base's, with ``model_type``, ``architectures`` and the dtype set; a
MiniGPT base is written as GPT-2, ``GPT2LMHeadModel``, in GPT-2's Conv1D layout, its character tokenizer as a
Hugging Face tokenizer.json encoding to the same ids), ``model.safetensors``
or shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``, and the base's tokenizer
files and ``generation_config.json`` copied. It is written to a temporary folder beside OUT and renamed
into place; an existing OUT is refused unless ``overwrite``, and is replaced only once the new one is complete.

``export_adapter`` (``minituner export``) is the whole path from folders: the base with the adapter (our file,
a run folder or a PEFT folder) on it (``trained_model.load_trained``), then ``export_merged``. An adapter
trained by QLoRA learned its update against the dequantized NF4 weights, not the original ones; as PEFT merges onto the
dequantized 4-bit base, so does the export: the base is loaded with the adapter's targets quantized by the
scheme the run's manifest.json records (``quant_scheme``), then dequantized and merged in float32.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from dataclasses import replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from minigpt.decoder import Decoder
from minigpt.base_folder import CONFIG, TOKENIZER, WEIGHTS, WEIGHTS_INDEX
from minigpt.errors import InputError
from minigpt.io import atomic_save_safetensors, atomic_write_text, read_json, usual_mode, write_json
from minigpt.model import MiniGPT
from minigpt.tokenizer import CharTokenizer
from minigpt.run_dir import check_creatable
from miniquant import QuantizedLinear

from .hf_config import ARCHITECTURES
from .hf_gpt2 import gpt2_config_dict, gpt2_state_dict_from_minigpt
from .tokenizer_files import char_tokenizer_as_hf
from .hf_load import checkpoint_files, read_headers
from .lora import LoRALinear
from .run_record import check_run_base
from .trained_model import load_trained
from .sft.templates import ChatTemplate, load_chat_template, save_chat_template, trained_template

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
          "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
Thunk = Callable[[], torch.Tensor]


def merged_weight(m: LoRALinear) -> torch.Tensor:
    """W + ΔW of the active adapters in float32 (W dequantized to float32 for a quantized base)."""
    base = m.base_layer
    w = base.weight.detach().float() if isinstance(base, nn.Linear) else base.dequantize(torch.float32)
    if m.merged_adapters or m.disabled:  # merged: W already holds ΔW; disabled: the base alone
        return w
    return w + m.delta_weight()


def merged_tensors(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype, Thunk]]:
    """Key -> (shape, dtype, function computing it) of the model's weights with every adapter merged.

    A LoRALinear contributes ``<path>.weight`` = W + ΔW (W dequantized when quantized) and its base bias;
    a QuantizedLinear outside LoRA its dequantized weight; other modules their own parameters and
    persistent buffers. Nothing is computed until a function is called.
    """
    out: dict[str, tuple[torch.Size, torch.dtype, Thunk]] = {}
    skip: tuple[str, ...] = ()
    for path, m in model.named_modules():
        if skip and path.startswith(skip):
            continue
        pre = f"{path}." if path else ""
        if isinstance(m, (LoRALinear, QuantizedLinear)):
            skip += (pre,)
            base = m.base_layer if isinstance(m, LoRALinear) else m
            wdtype = base.weight.dtype if isinstance(base, nn.Linear) else base.weight_dtype
            merge = (lambda m=m: merged_weight(m)) if isinstance(m, LoRALinear) else (
                lambda m=m: m.dequantize(torch.float32))
            out[pre + "weight"] = (torch.Size((m.out_features, m.in_features)), wdtype, merge)
            if base.bias is not None:
                out[pre + "bias"] = (base.bias.shape, base.bias.dtype, lambda b=base.bias: b.detach())
            continue
        tensors = dict(m.named_parameters(recurse=False))
        tensors.update((n, b) for n, b in m.named_buffers(recurse=False)
                       if b is not None and n not in m._non_persistent_buffers_set)
        for name, t in tensors.items():
            out[pre + name] = (t.shape, t.dtype, lambda t=t: t.detach())
    return out


def base_dtype(base_folder: Path) -> torch.dtype:
    """The dtype most of the base checkpoint's float tensors have (read from the headers only)."""
    counts = Counter(i.dtype for i in read_headers(checkpoint_files(base_folder)).values() if i.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most max_shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for k, n in sizes.items():
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += n
    return shards


def _write_weights(tmp: Path, tensors: dict[str, tuple[torch.Size, torch.dtype, Thunk]], dtype: torch.dtype,
                   max_shard_bytes: int) -> None:
    def out_dtype(d: torch.dtype) -> torch.dtype:
        return dtype if d.is_floating_point else d

    sizes = {k: s.numel() * out_dtype(d).itemsize for k, (s, d, _) in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, keys in zip(names, shards):
        with torch.no_grad():
            data = {}
            for k in keys:
                t = tensors[k][2]()
                data[k] = t.to(device="cpu", dtype=out_dtype(t.dtype)).contiguous()
                if data[k].is_floating_point() and not torch.isfinite(data[k]).all():
                    raise InputError(f"merged tensor {k} has non-finite values in {dtype}; nothing was written")
        atomic_save_safetensors(data, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del data
    if len(shards) > 1:
        write_json(tmp / WEIGHTS_INDEX,
                   {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def _gpt2_tensors(model: MiniGPT) -> dict[str, tuple[torch.Size, torch.dtype, Thunk]]:
    """A MiniGPT (GPT-2) with adapters -> GPT2LMHeadModel keys, merged (small models: computed at once)."""
    merged = {k: fn() for k, (_, _, fn) in merged_tensors(model).items()}
    with torch.device("meta"):
        plain = MiniGPT(model.config)
    plain.load_state_dict(merged, strict=True, assign=True)
    if model.config.tie_weights:
        plain.lm_head.weight = plain.wte.weight
    sd = gpt2_state_dict_from_minigpt(plain)
    return {k: (v.shape, v.dtype, lambda v=v: v) for k, v in sd.items()}


def _check_options(dtype: torch.dtype | None, max_shard_bytes: int) -> None:
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InputError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise InputError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")


def check_out(out: Path, overwrite: bool, keep: tuple[str | Path, ...] = ()) -> None:
    """An existing OUT is refused unless `overwrite`; one that is not a folder always; so is an OUT that is or holds
    a path of `keep` (the base, the adapter) or the current folder, which replacing OUT would delete, and one that
    holds anything an export does not write (``_not_exported``): --overwrite replaces an earlier export only."""
    if out.exists() and not overwrite:
        raise InputError(f"{out}: already exists (pass --overwrite to replace it)")
    check_creatable(out)
    target = out.resolve()
    for path, what in [*((p, str(p)) for p in keep), (Path.cwd(), "the current folder")]:
        held = Path(path).resolve()
        if held == target or target in held.parents:
            raise InputError(f"--out {out} is or holds {what}, which writing it would replace: choose another --out")
    foreign = _not_exported(out) if out.is_dir() else []
    if foreign:
        raise InputError(f"--out {out} holds what an export does not write ({foreign[0]}"
                         f"{', ...' if len(foreign) > 1 else ''}): --overwrite replaces an earlier export only; "
                         "choose another --out")


EXPORTED = (CONFIG, WEIGHTS, WEIGHTS_INDEX, "model-*-of-*.safetensors", *COPIED)  # what an export writes


def _not_exported(folder: Path) -> list[str]:
    """The entries of `folder` that write_hf_folder never writes (a run's adapter, the user's own files)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() or not any(fnmatch(p.name, e) for e in EXPORTED))


def write_hf_folder(model: nn.Module, base_folder: str | Path, folder: str | Path, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 10**9, template: ChatTemplate | None = None) -> None:
    """Write ``model`` (adapters merged) as Hugging Face files into the existing `folder`: weights, config.json,
    the base's tokenizer files and generation_config. dtype None: the base checkpoint's dtype. `template`: the chat
    template the folder carries in place of the base's (the one a run trained with)."""
    base_folder, folder = Path(base_folder), Path(folder)
    _check_options(dtype, max_shard_bytes)
    config = read_json(base_folder / CONFIG)
    dtype = dtype or base_dtype(base_folder)
    if isinstance(model, Decoder):
        family = model.config.model_type
        config["attention_dropout"] = model.config.attention_dropout  # as trained (finetune --model-dropout)
        tensors = merged_tensors(model)
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
    elif isinstance(model, MiniGPT):
        family = "gpt2"
        tensors = _gpt2_tensors(model)
        from_minigpt = config.get("model_type", "minigpt") == "minigpt"
        config = {} if from_minigpt else {k: v for k, v in config.items() if k not in ("format",)}
        config.update(gpt2_config_dict(model.config))
        if from_minigpt:  # characters: no token ends a text (GPT2Config's default 50256 lies outside the vocab)
            config.update(bos_token_id=None, eos_token_id=None)
    else:
        raise InputError(f"export_merged takes a Decoder or a MiniGPT, got {type(model).__name__}")
    config.pop("quantization_config", None)
    config.update(model_type=family, architectures=[ARCHITECTURES[family]], dtype=DTYPE_NAMES.get(dtype, "float32"),
                  torch_dtype=DTYPE_NAMES.get(dtype, "float32"))
    _write_weights(folder, tensors, dtype, max_shard_bytes)
    for name in COPIED:
        if (base_folder / name).is_file():
            shutil.copyfile(base_folder / name, folder / name)
    if isinstance(model, MiniGPT) and from_minigpt and (base_folder / TOKENIZER).is_file():
        _write_char_tokenizer(CharTokenizer.load(base_folder / TOKENIZER), template or load_chat_template(base_folder),
                              folder, model.config.block_size)
    elif template is not None:
        save_chat_template(folder, template)
    write_json(folder / CONFIG, config)


def _write_char_tokenizer(tok: CharTokenizer, template: ChatTemplate, folder: Path, context: int) -> None:
    """A MiniGPT's character tokenizer as the Hugging Face files AutoTokenizer reads, encoding as it does, with the
    chat template finetune rendered (its special tokens, e.g. the text "<|end|>" ending an answer, set inside it:
    as tokenizer_config entries transformers would add them to the vocabulary as new tokens)."""
    atomic_write_text(folder / TOKENIZER, char_tokenizer_as_hf(tok))
    write_json(folder / "tokenizer_config.json",  # no unk_token here: transformers would then match the text
               {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,  # "<unk>" as one token
                "clean_up_tokenization_spaces": False})
    # every special token set inside the template, and chat_template.jinja (read first) replacing a copied one
    save_chat_template(folder, replace(template, pinned=tuple(template.special_tokens)))


def export_merged(model: nn.Module, base_folder: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                  overwrite: bool = False, max_shard_bytes: int = 5 * 10**9,
                  template: ChatTemplate | None = None) -> Path:
    """Write ``model`` (a Decoder or MiniGPT, adapters merged) as a Hugging Face folder at ``out``; return it.

    dtype None: the base checkpoint's dtype. template: the chat template to write in place of the base's. The model
    itself is not changed.
    """
    out = Path(out)
    check_out(out, overwrite, (base_folder,))
    _check_options(dtype, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}."))
    try:
        os.chmod(tmp, usual_mode(folder=True))
        write_hf_folder(model, base_folder, tmp, dtype, max_shard_bytes, template)
        if out.exists():  # replace only now that the new folder is complete
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".old-{out.name}."))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_adapter(base: str | Path, adapter: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                   quant_scheme: str | None = "auto", overwrite: bool = False, allow_other_base: bool = False) -> Path:
    """Merge the adapter at `adapter` into the base folder `base` and write a Hugging Face folder at `out`.

    quant_scheme: "auto" takes the run's (``trained_model.load_trained``); None merges onto the float base; a scheme
    name merges onto the base with the adapter's targets quantized by it, then dequantized (QLoRA).
    The base must hold the weights the run trained on (``check_run_base``) unless `allow_other_base`.
    """
    out = Path(out)
    check_out(out, overwrite, (base, adapter))  # before any weight is read
    _check_options(dtype, 1)
    if not allow_other_base:
        check_run_base(base, adapter)
    model, _ = load_trained(base, adapter, quant_scheme)  # a QLoRA run's targets quantized as it trained them
    trained = trained_template(adapter)  # what the run rendered its chats with; else the base's stays
    template = load_chat_template(base, trained) if trained is not None else None
    return export_merged(model, base, out, dtype, overwrite, template=template)

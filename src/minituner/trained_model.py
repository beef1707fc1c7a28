"""A base with a finetune run's adapter on it, as the run trained it: what export, eval and generate use.

    model, tokenizer = load_trained(base, adapter)      # quant_scheme="auto": the run's scheme, if it had one

A QLoRA adapter learned its update against the quantized (NF4) weights of its targets, not the original ones,
and that is the model people serve: PEFT over a 4-bit base, or the merge onto the dequantized base that
``minituner export`` writes. So with quant_scheme "auto" the adapter's targets are quantized by the scheme the
run's manifest.json records, or for an adapter file read without its run the scheme the file records
(``run_record.run_quant_scheme``), as the base is read; None reads the float base.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from .adapter_io import load_adapter, read_adapter
from .adapter_tensors import module_paths
from .base_model import load_base
from .qlora import check_scheme
from .run_record import run_quant_scheme


def trained_scheme(adapter: str | Path, quant_scheme: str | None = "auto") -> str | None:
    """The scheme the adapter's targets are quantized by: the run's for "auto", none for None, else the one given."""
    if quant_scheme == "auto":
        return run_quant_scheme(adapter)
    return check_scheme(quant_scheme) if quant_scheme else None


def load_trained(base: str | Path, adapter: str | Path, quant_scheme: str | None = "auto",
                 device: str | torch.device = "cpu") -> tuple[nn.Module, object]:
    """(model, tokenizer) of the base folder with the adapter loaded, its targets quantized by `trained_scheme`."""
    scheme = trained_scheme(adapter, quant_scheme)
    quantize = (module_paths(read_adapter(adapter)[0]), scheme) if scheme else None
    model, tokenizer = load_base(base, device, quantize=quantize)
    load_adapter(model, adapter)
    return model, tokenizer

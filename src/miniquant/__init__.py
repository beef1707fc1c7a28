"""miniquant: symmetric per-group integer quantization (Phase 26) and NF4 (QLoRA).

Imports neither minigpt nor minituner. Bad input (NaN/Inf values, an unsupported dtype, an unknown
scheme) raises QuantizationError, a ValueError.
"""
from .errors import QuantizationError
from .int_quant import IntQuantized, dequantize_symmetric_per_group, quantize_symmetric_per_group
from .nf4 import NF4Tensor, dequantize_nf4, double_quantize, nf4_code_table, quantize_nf4
from .packing import pack_nibbles, unpack_nibbles
from .quantize import DEFAULT_QUANT_SCHEME, QuantizedLinear, QuantScheme, parse_scheme

__all__ = [
    "DEFAULT_QUANT_SCHEME",
    "IntQuantized",
    "NF4Tensor",
    "QuantScheme",
    "QuantizationError",
    "QuantizedLinear",
    "dequantize_nf4",
    "dequantize_symmetric_per_group",
    "double_quantize",
    "nf4_code_table",
    "pack_nibbles",
    "parse_scheme",
    "quantize_nf4",
    "quantize_symmetric_per_group",
    "unpack_nibbles",
]

"""miniquant's own error type (miniquant imports neither minigpt nor minituner)."""


class QuantizationError(ValueError):
    """Bad input to a quantizer: NaN/Inf values, an unsupported dtype, a bad blocksize or scheme."""

"""miniquant: symmetric per-group integer quantization (Phase 26) and NF4 (QLoRA)."""

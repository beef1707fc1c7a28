"""minituner: LoRA and QLoRA on MiniGPT and Hugging Face models, the memory planner, and the CLI."""
__version__ = "0.1.0"

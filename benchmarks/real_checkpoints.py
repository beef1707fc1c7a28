"""Random-weight Hugging Face checkpoints of real shapes (Llama-3.2-1B, Llama-2-7B, SmolLM2-135M, Qwen2.5-0.5B),
written to disk.

No hub is reachable, so the benchmarks make their own: the config.json of the real model, and
safetensors shards (at most 5 GB each, with model.safetensors.index.json) holding random bf16
weights of exactly the real names and shapes. The names and shapes come from transformers' own
class built on the meta device (no memory), so the folder is what `save_pretrained` would write.
Tensors are generated and written one shard at a time: writing a 7B checkpoint holds one shard
(≤ 5 GB) in memory, never the model.

    python benchmarks/real_checkpoints.py --shape llama-3.2-1b --out /tmp/llama-1b
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# The config.json fields of the released models (values from their model cards' config.json).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16",
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 24, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
}
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size "5GB"


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor save_pretrained writes (tied head stored once), from the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Norm weights 1, everything else N(0, 0.02) (the models' initializer_range)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_checkpoint(folder: str | Path, shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write config.json, generation_config.json and safetensors shards of random weights; return the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape])
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    shapes = tensor_shapes(config)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    size = 0
    for name, s in shapes.items():
        nbytes = itemsize * int(torch.Size(s).numel())
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(groups, start=1):
        file = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: random_tensor(n, shapes[n], gen, dtype) for n in names}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
        weight_map.update({n: file for n in names})
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    os.sync()
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = p.parse_args()
    write_checkpoint(args.out, args.shape, getattr(torch, args.dtype))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

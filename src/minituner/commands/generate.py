"""minituner generate: sample text from a base model (optionally with a LoRA adapter), or answer a chat question."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from minigpt.bf16_support import bf16_support
from minigpt.device import check_precision
from minigpt.errors import InputError

from ..base_model import check_weights_finite, load_base, load_tokenizer
from ..precision import compute_in_bf16, inference_precision, stored_precision
from ..run_record import check_run_base
from ..sft import answer, load_chat_template, trained_template
from ..trained_model import load_trained
from ..memory.available import available_memory
from ..upcast import compute_in_fp32_for_generation
from ._common import (add_adapter_base_arguments, add_inference_precision_arguments, non_negative_float, positive_int,
                      quant_scheme, seed, text)

HELP = ("print samples from a base model folder (minituner base, or Hugging Face gpt2/llama/mistral/qwen2 with its "
        "tokenizer; sampling stops at the eos id(s) of generation_config.json or config.json), optionally with a "
        "LoRA adapter; --chat asks a question through the base's chat template")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, default=Path("artifacts/base"),
                   help="model folder: MiniGPT, or Hugging Face gpt2, llama, mistral or qwen2 (default %(default)s)")
    p.add_argument("--adapter", type=Path, help="LoRA adapter: a finetune run folder, a PEFT folder or an adapter file")
    add_adapter_base_arguments(p)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", type=text, default="\n", help="text to continue (default: a newline)")
    what.add_argument("--chat", type=text, metavar="QUESTION",
                      help="a user message, rendered with the base's chat template (or the default one); "
                           "prints the answer, cut at the end-of-turn token")
    p.add_argument("--system", type=text, help="--chat: a system message before the question")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="--chat: a Jinja chat template (default: the one the --adapter run trained with, else the "
                        "base's)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200,
                   help="tokens to sample at most; an eos id stops sooner (default %(default)s)")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="samples to print (--prompt: drawn 8 at a time) (default %(default)s)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="sampling temperature; 0 is greedy (default 0.8 with --prompt, 0 with --chat)")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample from the k likeliest tokens only (default: all)")
    p.add_argument("--seed", type=seed, default=0, help="sampling seed (default %(default)s)")
    add_inference_precision_arguments(p, "bf16 for a Hugging Face checkpoint stored in bf16 (computed as stored: about "
                                         "2x faster a token), else fp32 (MiniGPT and GPT-2 folders are read in fp32)",
                                      cuda=False)


SAMPLES_AT_ONCE = 8  # --prompt samples drawn together (one batch, its KV cache and logits), printed as they come


def run(args: argparse.Namespace) -> int:
    if args.precision == "bf16":  # asked for on a CPU without bf16 units: refused before anything is read
        check_precision("bf16", "cpu", args.allow_slow_bf16)
    scheme = quant_scheme(args)  # a mistyped scheme refused before a base is hashed or read
    if args.adapter is not None and not args.allow_other_base:
        check_run_base(args.base, args.adapter, "use")  # before the base is loaded
    if args.adapter is None:
        model, tokenizer = load_base(args.base)
    else:  # a QLoRA adapter on its targets quantized as its run trained them (--quant-scheme)
        model, tokenizer = load_trained(args.base, args.adapter, scheme)
    if tokenizer is None:
        raise InputError(load_tokenizer(args.base, model.config.vocab_size)[1])
    check_weights_finite(model, args.base)
    if inference_precision(args.precision, stored_precision(model), bf16_support("cpu")) == "bf16":
        compute_in_bf16(model)
    elif not compute_in_fp32_for_generation(model, available_memory().bytes):  # fp32: upcast once where it fits
        print("note: an fp32 copy of this 16-bit model would take more than half the memory available: each product "
              "casts its weight to fp32 (slower a token)", file=sys.stderr)
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    if args.chat is not None:
        if not args.chat.strip():
            raise InputError("--chat is empty")
        if args.system is not None and not args.system.strip():
            raise InputError("--system is empty")
        template = load_chat_template(args.base, args.chat_template or trained_template(args.adapter))
        temperature = 0.0 if args.temperature is None else args.temperature
        for i in range(args.num_samples):
            if args.num_samples > 1:
                print(f"--- answer {i + 1} ---")
            print(answer(model, tokenizer, template, args.chat, args.system, args.max_new_tokens, temperature,
                         args.top_k, gen))
        return 0
    if args.system is not None or args.chat_template is not None:
        raise InputError("--system and --chat-template apply to --chat")
    if not args.prompt:
        raise InputError("--prompt is empty")
    temperature = 0.8 if args.temperature is None else args.temperature
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise InputError(f"--prompt {args.prompt!r} encodes to no token with {args.base}'s tokenizer; give a prompt "
                         "with text in it")
    eos = getattr(tokenizer, "eos_ids", None)  # a Hugging Face folder's end-of-sequence id(s)
    for first in range(0, args.num_samples, SAMPLES_AT_ONCE):  # memory bounded whatever --num-samples asks
        rows = min(SAMPLES_AT_ONCE, args.num_samples - first)
        out = model.generate(torch.tensor([ids] * rows, dtype=torch.long), args.max_new_tokens,
                             temperature=temperature, top_k=args.top_k, generator=gen, eos_id=eos)
        for i, row in enumerate(out, start=first + 1):
            print(f"--- sample {i} ---")
            print(tokenizer.decode(row.tolist()), flush=True)
    return 0

"""minituner finetune: train a LoRA adapter (or every parameter, --full) on top of a base folder."""
from __future__ import annotations

import argparse
from pathlib import Path

from minigpt.device import DEVICES, check_precision, resolve_device
from minigpt.distributed import init_from_env, is_writer, local_rank, shutdown
from minigpt.errors import InputError
from minigpt.train import TrainConfig
from miniquant import DEFAULT_QUANT_SCHEME

from ..finetune import BASE_DOMAIN, DEFAULT_DATA, FinetuneConfig, default_train_config, finetune
from ..lora import ALL_LINEAR, LoRAConfig
from ..run_record import check_run_base
from ._common import (add_precision_arguments, add_run_arguments, add_sft_arguments, checkpoint_options,
                      non_negative_float, non_negative_int, positive_float, positive_int, seed)

HELP = ("fine-tune a base model with LoRA (default) or fully; writes adapter_final.safetensors, a PEFT folder, "
        "metrics.jsonl, loss_curve.png and manifest.json")


def rank(text: str) -> int:
    """r is validated by the library (r <= 0, r > min(in, out) are one-line errors), so any integer parses."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer rank, got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, lora = default_train_config(), LoRAConfig()
    p.add_argument("--base", type=Path, default=Path("artifacts/base"),
                   help="base model folder: minituner, or Hugging Face gpt2/llama/mistral/qwen2 (default %(default)s)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="text file or folder; .jsonl/.json/.parquet/.arrow instruction or chat data (file or "
                        "folder); or builtin:NAME "
                        "(forecasts: text, forecast-qa: questions and answers) (default %(default)s)")
    add_sft_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="run folder to write")
    p.add_argument("--rank", type=rank, default=lora.r, help="LoRA rank r (default %(default)s)")
    p.add_argument("--alpha", type=number, default=lora.alpha, help="lora_alpha; scaling = alpha/r (default %(default)s)")
    p.add_argument("--dropout", type=float, default=lora.dropout, help="dropout on the LoRA path (default %(default)s)")
    p.add_argument("--model-dropout", type=number, metavar="P",
                   help="the model's own dropout while training (attention, residual, embeddings; the llama family's "
                        "attention) in place of its config's (default: the config's, GPT-2's 0.1; a full fine-tune's "
                        "saved config records it)")
    p.add_argument("--target", default=ALL_LINEAR,
                   help="comma-separated module names (q_proj,v_proj), path suffixes, or all-linear (default)")
    p.add_argument("--use-rslora", action="store_true", help="scale by alpha/sqrt(r) instead of alpha/r")
    p.add_argument("--full", action="store_true", help="full fine-tuning: train every parameter, save a base folder")
    p.add_argument("--init-adapter", type=Path, help="start from this adapter (file, run folder or PEFT folder)")
    p.add_argument("--allow-other-base", action="store_true",
                   help="start from --init-adapter even when --base's weights differ from those its run's "
                        "manifest.json records (e.g. the same model converted to another dtype)")
    p.add_argument("--qlora", action="store_true", help="QLoRA: quantize the targeted Linears (NF4) before adding LoRA")
    p.add_argument("--quant-scheme", help=f"QLoRA's scheme: {DEFAULT_QUANT_SCHEME} (default with --qlora), "
                   "int8_per_group_<G> or int4_per_group_<G>; implies --qlora")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, help=f"optimizer steps (default {d.steps})")
    length.add_argument("--epochs", type=positive_float, help="passes over the training split instead of --steps")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="sequences per forward and backward (default %(default)s; on a CPU, 1 for a 1B model)")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, metavar="N",
                   help="gradient accumulation: N batches of --batch-size per optimizer step, their gradients "
                        "adding up (transformers' gradient_accumulation_steps): the step of N x --batch-size "
                        "sequences in the memory of one batch (default %(default)s)")
    p.add_argument("--seq-len", type=positive_int, metavar="N",
                   help="training window in tokens (default: a MiniGPT base's block size; for a Hugging Face base the "
                        "smaller of its context and 512); longer than the model's context is refused")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate of AdamW (default %(default)s)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default=d.schedule,
                   help="learning rate after the warm-up: cosine decay to a tenth of --lr, or constant (default "
                        "%(default)s)")
    p.add_argument("--warmup-steps", type=non_negative_int, default=d.warmup_steps,
                   help="steps of linear warm-up to --lr (default %(default)s, at most the run's steps)")
    p.add_argument("--grad-clip", type=non_negative_float, default=d.grad_clip, help="max grad norm; 0 disables")
    p.add_argument("--eval-every", type=positive_int, default=d.eval_every,
                   help="steps between validation losses (default %(default)s; the last step is always evaluated)")
    p.add_argument("--seed", type=seed, default=d.seed,
                   help="seed of the LoRA init, data order and dropout (default %(default)s)")
    p.add_argument("--base-domain", default=BASE_DOMAIN,
                   help="also report val loss on this data before/after (forgetting); 'none' skips (default %(default)s)")
    p.add_argument("--allow-unknown-chars", action="store_true",
                   help="train on characters the base tokenizer never saw (as <unk>) instead of refusing the data")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: cuda if available, else cpu; under torchrun each process takes cuda:LOCAL_RANK")
    add_precision_arguments(p)
    add_run_arguments(p)
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each block in backward (torch.utils.checkpoint): less activation memory, same "
                        "result, about one more forward per step")
    p.add_argument("--no-heap-trims", action="store_true",
                   help="CPU: keep the heap's freed pages resident during the forward (a few %% faster steps, a "
                        "higher peak; by default they go back to the system, minituner.memory.heap)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the log lines stay)")


def run(args: argparse.Namespace) -> int:
    if args.full and args.init_adapter:
        raise InputError("--init-adapter needs LoRA, not --full")
    if args.allow_other_base and not args.init_adapter:
        raise InputError("--allow-other-base applies to an --init-adapter")
    quant_scheme = args.quant_scheme or (DEFAULT_QUANT_SCHEME if args.qlora else None)
    if args.full and quant_scheme:
        raise InputError("--qlora / --quant-scheme train LoRA on a quantized base, not --full")
    d = default_train_config()
    steps = args.steps or d.steps
    train = TrainConfig(steps=steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                        warmup_steps=min(args.warmup_steps, steps),
                        schedule=args.schedule, grad_clip=args.grad_clip, eval_every=min(args.eval_every, steps),
                        eval_batches=d.eval_batches, seed=args.seed, precision=args.precision,
                        grad_checkpoint=args.grad_checkpoint, **checkpoint_options(args))
    lora = LoRAConfig(r=args.rank, alpha=args.alpha, dropout=args.dropout, target_modules=args.target,
                      use_rslora=args.use_rslora)
    cfg = FinetuneConfig(data=args.data, method="full" if args.full else "lora", lora=lora, train=train,
                         quant_scheme=quant_scheme,
                         epochs=args.epochs, init_adapter=str(args.init_adapter) if args.init_adapter else None,
                         allow_other_base=args.allow_other_base,
                         base_domain=None if args.base_domain.lower() == "none" else args.base_domain,
                         allow_unknown_chars=args.allow_unknown_chars, seq_len=args.seq_len,
                         format=args.format, train_on_inputs=args.train_on_inputs, overlong=args.overlong,
                         model_dropout=args.model_dropout,
                         chat_template=str(args.chat_template) if args.chat_template else None,
                         columns=args.columns, data_config=args.data_config, data_splits=args.data_split)
    device = resolve_device(args.device, local_rank())
    check_precision(args.precision, device, args.allow_slow_bf16)  # refused before anything is loaded
    if args.init_adapter and not args.allow_other_base:  # as eval, generate and export check their --adapter
        check_run_base(args.base, args.init_adapter, "start from")
    init_from_env(device)  # torchrun: join the process group (gloo on CPU, nccl on CUDA)
    writer = is_writer()
    try:
        finetune(args.base, args.out, cfg, progress=not args.no_progress, overwrite=args.overwrite,
                 resume=args.resume, device=device, allow_slow_bf16=args.allow_slow_bf16,
                 heap_trims=not args.no_heap_trims)
    finally:
        shutdown()
    if writer:
        print(f"wrote {args.out}/")
    return 0

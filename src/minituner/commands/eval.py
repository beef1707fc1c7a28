"""minituner eval: mean loss over the counted tokens of a data set, perplexity and counts, for a base (+ adapter)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from minigpt.bf16_support import bf16_support
from minigpt.device import DEVICES, check_precision, resolve_device
from minigpt.errors import InputError

from ..base_model import base_config, check_weights_finite, load_base, load_tokenizer
from ..evaluation import SPLITS, evaluate_data
from ..finetune import training_window
from ..precision import compute_in_bf16, inference_precision
from ..qlora import quantized_modules
from ..run_record import check_run_base, trained_precision, trained_reading, trained_selection, trained_seq_len
from ..sft import FORMATS, SFTConfig, is_sft_source, trained_template
from ..sft.examples import OVERLONG
from ..trained_model import load_trained
from ..upcast import compute_in_fp32
from ._common import (add_adapter_base_arguments, add_inference_precision_arguments, add_selection_arguments,
                      data_selection, positive_int, quant_scheme)

HELP = ("mean loss over the counted tokens of --data (answers only for instruction data, every token for text), "
        "perplexity, examples and tokens; --json prints one object")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, default=Path("artifacts/base"), help="base model folder (default %(default)s)")
    p.add_argument("--adapter", type=Path, help="LoRA adapter: a finetune run folder, a PEFT folder or an adapter file")
    add_adapter_base_arguments(p)
    p.add_argument("--data", required=True,
                   help="text file or folder, .jsonl/.json/.parquet/.arrow instruction or chat data, or builtin:NAME")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="evaluate one split as finetune splits the data, or all of it (default %(default)s)")
    p.add_argument("--format", choices=FORMATS,
                   help="a data file's shape (default: the --adapter run's for its own data, else recognised per "
                        "file)")
    add_selection_arguments(p, from_run=True)
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template for the chats (default: the one the --adapter run trained with, else "
                        "the base's)")
    p.add_argument("--train-on-inputs", action=argparse.BooleanOptionalAction, default=None,
                   help="instruction data: count the prompt and user tokens too (default: as the --adapter run "
                        "counted its own data, else answers only)")
    p.add_argument("--seq-len", type=positive_int, metavar="N",
                   help="window in tokens: text is cut into windows of N, a longer example is truncated or dropped "
                        "(default: the --adapter run's --seq-len, else finetune's default: a MiniGPT base's block "
                        "size, for a Hugging Face base the smaller of its context and 512)")
    p.add_argument("--overlong", choices=OVERLONG,
                   help="an example longer than the window is truncated or dropped (default: the --adapter run's "
                        "for its own data, else truncate)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sequences per forward (default %(default)s)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu (default), cuda, or auto")
    add_inference_precision_arguments(p, "the precision the --adapter run trained in (so its val loss is the run's), "
                                         "else fp32")
    p.add_argument("--json", action="store_true",
                   help='print one object: {"loss", "perplexity", "examples", "tokens"}')


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.precision == "bf16":  # asked for where bf16 is slow: refused before anything is read
        check_precision("bf16", device, args.allow_slow_bf16)
    scheme = quant_scheme(args)  # a mistyped scheme refused before a base is hashed or read
    if args.adapter is not None and not args.allow_other_base:
        check_run_base(args.base, args.adapter, "use")  # before the base is loaded
    # the window finetune's val loss used: a Llama 3 config's context (131,072) would make one window of all the text
    trained = None if args.seq_len else trained_seq_len(args.adapter)
    context = base_config(args.base).block_size
    if trained and trained > context:  # the run's window, on a base of shorter context (--allow-other-base)
        raise InputError(f"{args.adapter}: its run trained with --seq-len {trained}, more than {args.base}'s context "
                         f"of {context} tokens; give eval --seq-len N")
    window = training_window(args.base, args.seq_len or trained)
    if args.adapter is None:
        model, tokenizer = load_base(args.base, device)
    else:  # a QLoRA adapter on its targets quantized as its run trained them (--quant-scheme)
        model, tokenizer = load_trained(args.base, args.adapter, scheme, device)
    if tokenizer is None:
        raise InputError(load_tokenizer(args.base, model.config.vocab_size)[1])
    check_weights_finite(model, args.base)
    if inference_precision(args.precision, trained_precision(args.adapter), bf16_support(device)) == "bf16":
        compute_in_bf16(model)  # as finetune computes in bf16
    elif device.type == "cpu" or args.precision == "fp32" or quantized_modules(model):
        compute_in_fp32(model)  # as finetune computes in fp32 (on CUDA a LoRA run keeps the checkpoint's dtype)
    model.eval()
    selection = data_selection(args, trained_selection(args.adapter, args.data))  # the run's, for its own data
    taken = [f for f in selection.flags() if f not in data_selection(args).flags()]
    data_format, sft, read_as_run = _reading(args)
    taken += read_as_run
    if taken:
        print(f"eval: reading {args.data} with its run's {', '.join(taken)} (as it trained on it)", file=sys.stderr)
    result = evaluate_data(model, tokenizer, args.base, args.data, args.split, data_format, sft, args.batch_size,
                           window, log=lambda m: print(m, file=sys.stderr),
                           template_file=args.chat_template or (trained_template(args.adapter)
                                                                if is_sft_source(args.data) else None),
                           selection=selection)
    if not math.isfinite(result.loss):
        raise FloatingPointError(f"the loss is {result.loss}: the model's logits are not finite (its weights, or "
                                 "the adapter's, hold nan or inf, or its config's numbers make them)")
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"{args.data} ({args.split}): loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
              f"{result.examples} examples, {result.tokens} counted tokens")
    return 0


def _reading(args: argparse.Namespace) -> tuple[str | None, SFTConfig, list[str]]:
    """--format, and --train-on-inputs and --overlong as an SFTConfig: each flag not given is what the --adapter run
    read its own data with (``trained_reading``), else the default; and those taken from the run, as flags."""
    run = trained_reading(args.adapter, args.data)
    taken = []
    data_format = args.format
    if data_format is None and run.get("format") is not None:
        data_format = run["format"]
        taken.append(f"--format {data_format}")
    train_on_inputs = args.train_on_inputs
    if train_on_inputs is None:
        train_on_inputs = run.get("train_on_inputs", False)
        taken += ["--train-on-inputs"] if train_on_inputs else []
    overlong = args.overlong
    if overlong is None:
        overlong = run.get("overlong", OVERLONG[0])
        taken += [f"--overlong {overlong}"] if overlong != OVERLONG[0] else []
    return data_format, SFTConfig(train_on_inputs, overlong), taken

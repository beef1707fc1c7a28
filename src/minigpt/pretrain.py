"""Pretrain the base MiniGPT on a corpus and write artifacts/base/."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from .base_folder import CONFIG, MANIFEST, TOKENIZER, WEIGHTS, save_base
from .distributed import barrier, is_writer
from .run_dir import check_inputs_outside_run, check_run_dir, replacing_run
from .data import PRETRAIN_DATA, encode_split, load_documents, split_documents, unigram_entropy
from .manifest import seed_everything, write_manifest
from .model import GPTConfig, MiniGPT
from .tokenizer import CharTokenizer
from .train import METRICS, TrainConfig, evaluate, train
from .train_state import CHECKPOINT_DIR

DEFAULT_DATA = PRETRAIN_DATA
# what a pretraining run writes: any of these and the folder holds a run, which --overwrite replaces
PRETRAIN_FILES = (WEIGHTS, MANIFEST, METRICS, CONFIG, TOKENIZER, CHECKPOINT_DIR, "loss_curve.png")


def pretrain(
    out: Path,
    data: str | Path = DEFAULT_DATA,
    model_overrides: dict | None = None,
    train_cfg: TrainConfig | None = None,
    progress: bool = True,
    log=print,
    overwrite: bool = False,
    resume: bool = False,
) -> dict:
    """Build the tokenizer from the train split, train MiniGPT, save the base folder; return a summary.

    A folder that already holds a base is refused unless `overwrite`, or `resume` (continue from its newest
    checkpoint, with the same data and settings).
    """
    train_cfg = train_cfg or TrainConfig()
    start = time.perf_counter()
    out = Path(out)
    check_run_dir(out, PRETRAIN_FILES, overwrite, resume)
    if overwrite:
        check_inputs_outside_run(out, PRETRAIN_FILES, PRETRAIN_FILES, {"--data": data})
    barrier()  # every rank has checked the folder before rank 0 writes to it
    with replacing_run(out, PRETRAIN_FILES, PRETRAIN_FILES, active=is_writer(), resuming=resume):
        return _pretrain(out, data, model_overrides, train_cfg, progress, log, resume, start)


def _pretrain(out: Path, data: str | Path, model_overrides: dict | None, train_cfg: TrainConfig, progress: bool, log,
              resume: bool, start: float) -> dict:
    """pretrain's run once its folder is checked (a failure before the first checkpoint leaves it as it was)."""
    seed_everything(train_cfg.seed)
    splits = split_documents(load_documents(data))
    tokenizer = CharTokenizer.train(splits.train)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, **(model_overrides or {}))
    train_ids = encode_split(splits.train, tokenizer, cfg.block_size, "train")
    val_ids = encode_split(splits.val, tokenizer, cfg.block_size, "val")
    entropy = unigram_entropy(train_ids, tokenizer.vocab_size)
    model = MiniGPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"MiniGPT: {n_params:,} parameters, vocab {tokenizer.vocab_size}, "
        f"{train_ids.numel():,} train / {val_ids.numel():,} val tokens from {data}")
    out.mkdir(parents=True, exist_ok=True)
    initial_val = evaluate(model, val_ids, cfg.block_size, train_cfg.batch_size, train_cfg.eval_batches)
    result = train(model, train_ids, val_ids, train_cfg, out_dir=out, progress=progress, resume=resume,
                   fingerprint={"data": str(data), "model": cfg.to_dict()}, log=log)
    save_base(model, tokenizer, out)
    summary = {
        "params": n_params,
        "unigram_entropy_nats": entropy,
        "initial_val_loss": initial_val,
        "final_val_loss": result.final_val_loss,
        "final_train_loss": result.final_train_loss,
        "train_wall_time_s": result.wall_time_s,
        "skipped_steps": result.skipped_steps,
    }
    write_manifest(
        out / MANIFEST,
        seed=train_cfg.seed,
        config={"model": cfg.to_dict(), "train": asdict(train_cfg), "data": str(data)},
        wall_time_s=time.perf_counter() - start,
        base_weights=out / WEIGHTS,
        extra={"results": summary, "resumes": result.resumes},
    )
    log(f"validation loss {result.final_val_loss:.3f} nats/token vs unigram entropy {entropy:.3f} "
        f"(untrained {initial_val:.3f}); {result.wall_time_s:.0f} s")
    return summary

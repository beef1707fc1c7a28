import json

from minigpt.base_folder import load_minigpt_folder
from minigpt.pretrain import pretrain
from minigpt.train import TrainConfig, lr_at


def test_pretrain_lowers_loss_and_writes_base(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"the cat sat on mat number {i % 7}." for i in range(400)))
    out = tmp_path / "base"
    cfg = TrainConfig(steps=60, batch_size=8, lr=1e-2, warmup_steps=5, eval_every=30, eval_batches=4, seed=3)
    summary = pretrain(out, data, dict(block_size=32, n_layer=1, n_head=2, d_model=16), cfg, progress=False,
                       log=lambda *_: None)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    assert summary["final_val_loss"] < summary["unigram_entropy_nats"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "manifest.json", "loss_curve.png",
                 "metrics.jsonl"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 3 and len(manifest["base_sha256"]) == 64
    assert manifest["versions"]["torch"]
    model, tok = load_minigpt_folder(out)
    assert tok.vocab_size == model.config.vocab_size


def test_pretrain_is_repeatable(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"line {i} of some text" for i in range(200)))
    cfg = TrainConfig(steps=10, batch_size=4, eval_every=10, eval_batches=2, seed=7)
    kw = dict(model_overrides=dict(block_size=16, n_layer=1, n_head=2, d_model=16), progress=False, log=lambda *_: None)
    pretrain(tmp_path / "a", data, train_cfg=cfg, **kw)
    pretrain(tmp_path / "b", data, train_cfg=cfg, **kw)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert abs(lr_at(99, cfg) - 0.1) < 1e-3
    assert TrainConfig(schedule="constant", warmup_steps=0).lr == lr_at(50, TrainConfig(schedule="constant", warmup_steps=0))

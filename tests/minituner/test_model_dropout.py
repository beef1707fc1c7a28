"""finetune --model-dropout: the model's own dropout set for a run (GPT-2's config carries 0.1), planned as it
trains, part of the run's identity only where it differs from the config's, recorded in a full fine-tune's
config.json; count --base plans the same run."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn as nn  # noqa: E402

from minigpt.train import TrainConfig  # noqa: E402
from minituner.cli import main  # noqa: E402
from minituner.dropout import config_dropout  # noqa: E402
from minituner.finetune import FinetuneConfig, finetune  # noqa: E402
from minituner.lora import LoRAConfig, LoRALinear  # noqa: E402

WINDOW = ["--rank", "4", "--batch-size", "2", "--seq-len", "8"]


def run(base, data, out, model_dropout=None, method="lora", steps=2, resume=False, checkpoint_every=0):
    cfg = FinetuneConfig(data=str(data), method=method, lora=LoRAConfig(r=4, alpha=8.0, dropout=0.05),
                         base_domain=None, seq_len=8, model_dropout=model_dropout,
                         train=TrainConfig(steps=steps, batch_size=2, eval_every=steps, eval_batches=1,
                                           checkpoint_every=checkpoint_every))
    return finetune(base, out, cfg, progress=False, log=lambda *_: None, resume=resume)


def dropout_rates(model: nn.Module) -> tuple[set[float], set[float]]:
    """(the model's own rates: its nn.Dropout modules and attention's dropout_p, LoRA's dropout rates)."""
    lora = [d for m in model.modules() if isinstance(m, LoRALinear) for d in m.lora_dropout.values()]
    own = {m.p for m in model.modules() if isinstance(m, nn.Dropout) and all(m is not d for d in lora)}
    own |= {m.dropout for m in model.modules() if isinstance(getattr(m, "dropout", None), float)}
    return own, {d.p for d in lora}


@pytest.mark.parametrize("model_dropout", [None, 0.0, 0.2])
def test_gpt2_trains_and_is_planned_with_the_dropout_asked_for(hf_folder, data, tmp_path, model_dropout):
    base = hf_folder("gpt2")  # resid_pdrop 0.1, as GPT-2's own configs
    res = run(base, data, tmp_path / "run", model_dropout)
    expected = 0.1 if model_dropout is None else model_dropout
    own, lora = dropout_rates(res.model)
    assert own == {expected} and lora == {0.05}  # LoRA's own dropout untouched
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["model_dropout"] == pytest.approx(expected)
    assert manifest["results"]["memory_plan"]["model_dropout"] == pytest.approx(expected)


def test_the_plan_without_dropout_is_memory_checks_and_smaller(hf_folder, capsys):
    """count --base --model-dropout 0 plans the run finetune --model-dropout 0 makes, as memory-check measures it."""
    base = hf_folder("gpt2")
    peaks = {}
    for given in ([], ["--model-dropout", "0"]):
        assert main(["count", "--base", str(base), *WINDOW, "--json", *given]) == 0
        plan = json.loads(capsys.readouterr().out)["finetune_cpu"]
        peaks[bool(given)] = plan["regimes"][1]["peak"]  # LoRA r=4
        assert plan["model_dropout"] == pytest.approx(0.0 if given else 0.1)
    assert peaks[True] < peaks[False]
    assert main(["memory-check", "--base", str(base), "--regime", "lora", *WINDOW, "--model-dropout", "0",
                 "--steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["peak"] == peaks[True]
    assert main(["count", "--base", str(base), *WINDOW, "--model-dropout", "0.2"]) == 0
    assert "the model's dropout 0.2 (--model-dropout; attention on SDPA's math path)" in capsys.readouterr().out


def killed_after_step_2(base, data, out, model_dropout):
    """A 4-step run with a checkpoint every 2 steps, as if killed after step 2's."""
    run(base, data, out, model_dropout, steps=4, checkpoint_every=2)
    (out / "checkpoints" / "step-00000004.safetensors").unlink()


def test_resume_needs_the_same_dropout_and_runs_without_the_flag_resume(hf_folder, data, tmp_path):
    base = hf_folder("gpt2")
    out = tmp_path / "run"
    killed_after_step_2(base, data, out, 0.0)
    with pytest.raises(Exception, match="different run.*model_dropout 0.0 -> None"):
        run(base, data, out, None, steps=4, resume=True, checkpoint_every=2)
    run(base, data, out, 0.0, steps=4, resume=True, checkpoint_every=2)
    assert [r["step"] for r in json.loads((out / "manifest.json").read_text())["resumes"]] == [2]
    # the config's own rate, given or not, is the same run (and a run started before the flag resumes)
    same = tmp_path / "same"
    killed_after_step_2(base, data, same, None)
    run(base, data, same, 0.1, steps=4, resume=True, checkpoint_every=2)
    assert [r["step"] for r in json.loads((same / "manifest.json").read_text())["resumes"]] == [2]


@pytest.mark.parametrize("family,model_dropout", [("gpt2", 0.0), ("llama", 0.1)])
def test_a_full_fine_tune_records_the_dropout_it_trained_with(hf_folder, data, tmp_path, family, model_dropout):
    base = hf_folder(family)
    run(base, data, tmp_path / "full", model_dropout, method="full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop") if family == "gpt2" else ("attention_dropout",)
    assert [config[k] for k in keys] == [pytest.approx(model_dropout)] * len(keys)
    from minituner.base_model import load_base
    assert config_dropout(load_base(tmp_path / "full")[0].config) == pytest.approx(model_dropout)


@pytest.mark.parametrize("bad", ["1", "-0.1", "nan"])
def test_a_rate_outside_0_1_is_one_line_and_nothing_written(hf_folder, data, tmp_path, capsys, bad):
    base = hf_folder("gpt2")
    out = tmp_path / "run"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--out", str(out), "--steps", "1",
                 "--model-dropout", bad, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the model's dropout must be in [0, 1)" in err and "Traceback" not in err
    assert not out.exists()


def test_the_warning_names_the_flag_when_the_model_has_dropout():
    from minituner.memory import run_plan

    plan = {"peak": 8 << 30, "weights": 1 << 30, "peak_phase": "backward", "batch_size": 32, "seq_len": 512,
            "counted_targets": 32 * 512, "available_bytes": 2 << 30, "available_limit": "the system's",
            "model_dropout": 0.1}
    assert "--model-dropout 0" in run_plan.describe_run_plan(plan, "")[1]
    assert "--model-dropout" not in run_plan.describe_run_plan({**plan, "model_dropout": 0.0}, "")[1]

"""QLoRA on real model shapes (Llama-3.2-1B, Llama-2-7B): ours against PEFT + bitsandbytes (issue 12, item 8).

For each shape a random-weight bf16 checkpoint is written to a temporary folder (real_checkpoints.py),
then each contender runs in its own subprocess (`python bench_real_models.py --contender ...`), so its
peak RSS is its own. At the 1B shape (PACED_SHAPES) both subprocesses stay alive and their timed steps
alternate (each loads and takes its first step in turn, then waits for the parent's "step"), so a ratio of
step times is measured under the same load; the 7B's contenders do not fit in memory together and run one
after the other:
- ours: load_base(folder, quantize=("all-linear", "nf4_per_group_64")) (every block Linear NF4 as it
  is read), then build_for_training(model, "qlora", ..., precision="fp32" | "bf16"): what
  `minituner finetune --method qlora --precision ...` builds;
- PEFT + bitsandbytes: AutoModelForCausalLM.from_pretrained(folder, quantization_config=
  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=X),
  device_map="cpu", dtype=X), then get_peft_model; bf16 runs the forward under torch.autocast("cpu").
The 7B shape also runs ours without the heap trims that build_for_training installs on CPU (heap_trims=False)
and ours with glibc's mmap threshold pinned (MALLOC_MMAP_THRESHOLD_), to show what glibc's heap adds to the peak.
Both: LoRA r 16, alpha 32 on all-linear (not lm_head), AdamW on the LoRA factors, batch 1 x 512 random
token ids, cross-entropy against random targets, each side's own: ours minigpt.train.lm_loss (as finetune),
theirs transformers' (the logits upcast to fp32, then F.cross_entropy). Peak RSS is the kernel's high-water mark (VmHWM),
reset before loading and again before the first training step.

    python benchmarks/bench_real_models.py --shapes llama-3.2-1b --out /tmp/real_models.md   # standalone
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from minigpt.bf16_support import bf16_support  # noqa: E402
from paced import run_paced, serve  # noqa: E402
from report import Goal, Section  # noqa: E402
from timing import (MIB, OPTIMIZER_NOTE, adamw, bf16_product_libraries, cpu_summary, current_rss_mib,  # noqa: E402
                    fp32_product_libraries, peak_rss_mib,
                    reset_peak_rss)

RANK, ALPHA = 16, 32.0
BATCH, SEQ = 1, 512
LR = 1e-4
SCHEME = "nf4_per_group_64"
CONTENDERS = {"ours": "ours (load_base NF4 + build_for_training)", "peft_bnb": "PEFT + bitsandbytes (load_in_4bit nf4)",
              "ours_mmap": "informational: ours, glibc MALLOC_MMAP_THRESHOLD_=131072",
              "ours_no_trims": "informational: ours without the heap trims (build_for_training(heap_trims=False))"}
DEFAULT_CONTENDERS = ("ours", "peft_bnb")
# glibc raises its mmap threshold (up to 32 MiB) after each large free, so later activations come from the heap
# and freed holes stay resident; a fixed threshold returns every large block to the OS when freed
CONTENDER_ENV = {"ours_mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # torch name -> planner MemoryConfig.dtype
LOAD_GOAL = 1.10  # peak RSS while loading / (planner QLoRA weights + largest tensor + baseline)
TRAIN_GOAL_7B = 1.15  # peak RSS while training / (planner peak + process baseline)
LOAD_SPEED_GOAL_7B = 10.0  # bnb load_in_4bit seconds / ours
STEP_GOAL_1B = 0.8  # our step / PEFT + bnb step, same compute dtype
# shape -> (compute dtypes, timed steps after the first): the 7B runs bf16 only, one step (a step takes minutes;
# with 0 the first step is the figure, warm-up costs included); the 1B 8 (with 4, PEFT's bf16 step moved 4.5 to
# 5.8 s from run to run, the goal's ratio with it, 2026-12-05/06)
PLAN = {"llama-3.2-1b": (("float32", "bfloat16"), 8), "llama-2-7b": (("bfloat16",), 1)}
# shapes whose contenders all fit in memory at once (1B: about 4 + 8 GiB at fp32): they run side by side, their
# timed steps alternating (_run_paced); the 7B's (8 + 20 GiB) run one after another
PACED_SHAPES = ("llama-3.2-1b",)
PACED_WARM = 1  # untimed steps at the start of each turn: a process's first step after the other's ran slower
PACED_TIMEOUT_S = 4 * 3600  # the whole paced run (as _run_contender's limit for one contender)
# the 7B also runs ours without the heap trims of minituner.memory.heap and with glibc's mmap threshold pinned:
# what the allocator's retained heap adds to the peak, and what each remedy costs
SHAPE_CONTENDERS = {"llama-2-7b": ("ours", "peft_bnb", "ours_no_trims", "ours_mmap")}
QUICK_PLAN = {"llama-3.2-1b": (("bfloat16",), 1)}


def plan_for(bf16_fast: bool, quick: bool = False) -> dict:
    """PLAN (QUICK_PLAN) for this CPU. Without bf16 units a bf16 step runs many times slower than an fp32 one
    (PyTorch's fallback products; the bf16 section times one against fp32), so there every shape runs in fp32 instead and
    the bf16 goal is not measurable."""
    plan = QUICK_PLAN if quick else PLAN
    return plan if bf16_fast else {shape: (("float32",), steps) for shape, (_, steps) in plan.items()}
SHORT = {"llama-3.2-1b": "1B", "llama-2-7b": "7B"}


# ---- one contender (runs inside the subprocess) --------------------------------------------------


def _build_ours(folder: str, dtype, heap_trims: bool = True):
    import torch

    from minituner.base_model import load_base
    from minituner.build import build_for_training
    from minituner.lora import LoRAConfig
    from minituner.qlora import quantized_modules

    def load():  # the one loader: block Linears quantized to NF4 as read, the rest in the checkpoint's bf16
        return load_base(folder, quantize=("all-linear", SCHEME))[0]

    def prepare(model):  # the one build path, as `finetune --qlora --precision fp32|bf16` builds it
        n_quantized = len(quantized_modules(model))
        bf16 = dtype == torch.bfloat16
        build_for_training(model, "qlora", LoRAConfig(r=RANK, alpha=ALPHA, target_modules="all-linear"), SCHEME,
                           "cpu", None if bf16 else torch.float32, precision="bf16" if bf16 else "fp32",
                           allow_slow_bf16=True, heap_trims=heap_trims)
        return model, {"quantized_layers": n_quantized}

    def loss(model, x, y):  # as finetune: minigpt.cross_entropy reads the head's logits in their dtype
        from minigpt.train import lm_loss

        return lm_loss(model, x, y)

    return load, prepare, loss


def _build_peft_bnb(folder: str, dtype):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def load():
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cpu", dtype=dtype)

    def prepare(model):
        import bitsandbytes as bnb

        n_quantized = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        model.config.use_cache = False
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
        return get_peft_model(model, cfg), {"quantized_layers": n_quantized}

    def loss(model, x, y):  # as transformers' ForCausalLMLoss: the logits upcast to fp32, then cross-entropy
        import torch.nn.functional as F

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return load, prepare, loss


def measure(contender: str, folder: str, dtype_name: str, steps: int, paced: bool = False) -> dict:
    """Load (timed, peak RSS), prepare, then 1 + `steps` optimizer steps (peak RSS over all of them).

    paced: after the first step, take each further step as the parent asks (paced.serve), until "done": the parent
    alternates two contenders' steps (_run_paced)."""
    import torch

    dtype = getattr(torch, dtype_name)
    load, prepare, loss_fn = (_build_peft_bnb(folder, dtype) if contender == "peft_bnb"
                              else _build_ours(folder, dtype, heap_trims=contender != "ours_no_trims"))
    gc.collect()
    baseline = current_rss_mib()  # torch and the contender's own libraries imported, nothing built
    reset_ok = reset_peak_rss()
    load_avg = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    model = load()
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    load_peak = peak_rss_mib()
    rss_loaded = current_rss_mib()
    split_loaded = _rss_split_mib()
    t0 = time.perf_counter()
    model, facts = prepare(model)
    prepare_s = time.perf_counter() - t0
    model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    y = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable, lr=LR)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)  # nothing holds the (B, T, V) logits through backward
        loss.backward()
        opt.step()
        return loss.item()

    gc.collect()
    rss_before_train = current_rss_mib()
    reset_peak_rss()
    times, losses, warm_times = [], [], []
    for _ in range(1 if paced else 1 + steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    if paced:  # the parent's turns (paced.run_paced)
        timed, warm_times, paced_losses = serve(step)
        times += timed
        losses += paced_losses
    train_peak = peak_rss_mib()
    split_trained = _rss_split_mib()
    return {"rss_anon_file_loaded_mib": split_loaded, "rss_anon_file_trained_mib": split_trained,"contender": contender, "dtype": dtype_name, "load_s": load_s, "load_cpu_s": load_cpu_s,
            "prepare_s": prepare_s, "baseline_mib": baseline, "load_peak_mib": load_peak,
            "rss_loaded_mib": rss_loaded, "rss_before_train_mib": rss_before_train, "train_peak_mib": train_peak,
            "first_step_s": times[0], "step_times": times[1:], "warm_step_times": warm_times, "losses": losses,
            "peak_reset": reset_ok,
            "trainable_params": sum(p.numel() for p in trainable), "threads": torch.get_num_threads(),
            "loadavg_at_start": load_avg, "loadavg_at_end": os.getloadavg()[0], **facts}


def _rss_split_mib() -> list[float]:
    """[anonymous, file-backed] resident MiB now (RssAnon, RssFile of /proc/self/status; [] elsewhere)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return [int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")]
    except (OSError, KeyError, ValueError):
        return []


# ---- the section (runs in the parent) ------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_into_page_cache(folder: Path, chunk_mib: int = 64) -> float:
    """Reads every file of folder once (into the page cache) and returns the seconds it took. Before each contender,
    so every load reads a warm cache: the first reader after the checkpoint was written otherwise paid for the cold
    read alone (a 7B load took 17.8 s cold against 5.0 s warm on the 2-core EPYC)."""
    t0 = time.perf_counter()
    buf = bytearray(chunk_mib * MIB)
    view = memoryview(buf)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
    return time.perf_counter() - t0


def _run_contender(contender: str, folder: Path, dtype: str, steps: int) -> dict:
    cache_s = read_into_page_cache(folder)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--contender", contender, "--folder", str(folder),
           "--dtype", dtype, "--steps", str(steps)]
    t0 = time.perf_counter()
    env = {**os.environ, **CONTENDER_ENV.get(contender, {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600, env=env)
    if out.returncode != 0:
        _log(f"[bench]   {contender} {dtype} failed:\n{out.stderr[-3000:]}")
        return {"contender": contender, "dtype": dtype, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    res["cache_read_s"] = cache_s
    return res


def _run_paced(contenders: tuple[str, ...], folder: Path, dtype: str, steps: int) -> list[dict]:
    """Every contender in its own live subprocess, their timed steps alternating (paced.run_paced). Each returns
    measure()'s result."""
    read_into_page_cache(folder)
    children = {name: ([sys.executable, str(Path(__file__).resolve()), "--contender", name, "--folder", str(folder),
                        "--dtype", dtype, "--steps", str(steps), "--paced"], CONTENDER_ENV.get(name))
                for name in contenders}
    results = run_paced(children, turns=steps, warm=PACED_WARM, timeout_s=PACED_TIMEOUT_S, label=f" {dtype}")
    return [res if "error" not in res else {"contender": name, "dtype": dtype, **res} for name, res in results.items()]


def _planner(folder: Path) -> dict:
    """_planner_shape and the checkpoint's largest tensor (name, MiB)."""
    from minituner.hf_load import checkpoint_files, read_headers

    out = _planner_shape(folder)
    infos = read_headers(checkpoint_files(folder))
    name, info = max(infos.items(), key=lambda kv: _numel(kv[1].shape) * kv[1].dtype.itemsize)
    out["largest"] = (name, _numel(info.shape) * info.dtype.itemsize / MIB)
    return out


def _planner_shape(folder: Path) -> dict:
    """What the planner says for this folder's QLoRA r=RANK run, MiB: the weights bucket with the base stored
    in bf16 ("load weights": what is resident after loading), and per compute dtype the predicted peak of a
    training step as `minituner memory-check` predicts it (planner/peak.py, exact activations) and its phase."""
    import torch

    from minituner.hf_config import read_decoder_config
    from minituner.memory.check import CheckConfig, predict
    from minituner.planner import MemoryConfig, Regime, load_config_shape, regime_bytes

    stored = regime_bytes(load_config_shape(folder), Regime("qlora", RANK), "all-linear",
                          MemoryConfig(batch_size=BATCH, seq_len=SEQ, dtype="bf16"))
    out: dict = {"load weights": stored.weights / MIB}
    cfg = read_decoder_config(folder)
    for dt in DTYPES.values():  # the checkpoint is bf16 (real_checkpoints): in fp32 its embedding and head stay bf16
        predicted, _, phase, _ = predict(cfg, CheckConfig(regime="qlora", rank=RANK, targets="all-linear",
                                                          batch_size=BATCH, seq_len=SEQ, precision=dt),
                                         base_dtype=torch.bfloat16)
        out[dt] = {"peak": predicted["peak"] / MIB, "phase": phase, "weights": predicted["weights"] / MIB,
                   "activations": predicted["activations"] / MIB}
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


def run(quick: bool = False, plan: dict | None = None, contenders: tuple[str, ...] | None = None) -> Section:
    from real_checkpoints import write_checkpoint

    plan = plan or plan_for(bf16_support("cpu").fast, quick)
    results: dict[str, list[dict]] = {}
    planner: dict[str, dict] = {}
    written: dict[str, tuple[float, float]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="minituner-real-models-", dir="/tmp"))
    try:
        for shape, (dtypes, steps) in plan.items():
            folder = tmp / shape
            t0 = time.perf_counter()
            _log(f"[bench]   real_models: writing a random {shape} bf16 checkpoint to {folder}")
            write_checkpoint(folder, shape)
            size = sum(p.stat().st_size for p in folder.iterdir()) / 2**30
            written[shape] = (time.perf_counter() - t0, size)
            planner[shape] = _planner(folder)
            results[shape] = []
            for dtype in dtypes:
                names = contenders or SHAPE_CONTENDERS.get(shape, DEFAULT_CONTENDERS)
                if shape in PACED_SHAPES:  # side by side, their timed steps alternating
                    _log(f"[bench]   real_models: {shape} {', '.join(names)} {dtype}, steps alternating (load "
                         f"average {os.getloadavg()[0]:.1f})")
                    for res in _run_paced(tuple(names), folder, dtype, steps):
                        results[shape].append({"shape": shape, "paced": True, **res})
                        _log(f"[bench]   -> {json.dumps(results[shape][-1])}")
                    continue
                for contender in names:  # one after another; the machine's load is logged beside each
                    _log(f"[bench]   real_models: {shape} {contender} {dtype} (load average {os.getloadavg()[0]:.1f})")
                    results[shape].append({"shape": shape, **_run_contender(contender, folder, dtype, steps)})
                    _log(f"[bench]   -> {json.dumps(results[shape][-1])}")
            _log(f"[bench]   -> {json.dumps({'shape': shape, 'written': written[shape], 'plan': [dtypes, steps]})}")
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return section(results, planner, written, plan)


def from_logs(logs: list[Path]) -> Section:
    """The section from the '[bench]   -> {json}' lines of earlier runs' stderr (to join a 1B and a 7B run)."""
    results: dict[str, list[dict]] = {}
    written: dict[str, tuple[float, float]] = {}
    plan: dict[str, tuple[tuple[str, ...], int]] = {}
    shape = None
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("[bench]   real_models: ") and " (load average " in line and "writing" not in line:
                shape = line.split()[2]
            if not line.startswith("[bench]   -> "):
                continue
            rec = json.loads(line.removeprefix("[bench]   -> "))
            if "written" in rec:
                written.setdefault(rec["shape"], tuple(rec["written"]))  # the first run of a shape
                plan[rec["shape"]] = (tuple(rec["plan"][0]), rec["plan"][1])
                continue
            rec.setdefault("shape", shape)
            results.setdefault(rec["shape"], []).append(rec)
    for sh, rows in results.items():
        plan.setdefault(sh, (tuple(dict.fromkeys(r["dtype"] for r in rows)),
                             max((len(r.get("step_times", [])) for r in rows), default=0)))
    return section(results, {sh: _planner_for(sh) for sh in results}, written, plan)


def _planner_for(shape: str) -> dict:
    """_planner of a shape without its weights: config.json and the tensor headers of an empty checkpoint."""
    from real_checkpoints import SHAPES, tensor_shapes

    with tempfile.TemporaryDirectory(prefix="minituner-real-models-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(SHAPES[shape]))
        shapes = tensor_shapes(SHAPES[shape])
        name = max(shapes, key=lambda n: _numel(shapes[n]))
        out = _planner_shape(folder)
        out["largest"] = (name, _numel(shapes[name]) * 2 / MIB)  # bf16
        return out


def section(results: dict[str, list[dict]], planner: dict, written: dict, plan: dict) -> Section:
    s = Section(
        "QLoRA on real model shapes: ours vs PEFT + bitsandbytes",
        f"CPU: {cpu_summary()}. Random-weight bf16 checkpoints of real shapes (config.json and tensor names "
        "of Llama-3.2-1B: 16 layers, d_model 2048, 32/8 heads, vocab 128,256, tied; Llama-2-7B: 32 layers, "
        "d_model 4096, vocab 32,000), written to a temporary folder and deleted after. Each contender runs "
        "in its own subprocess; at the 1B shape both stay alive and, after each has loaded and taken its first "
        "step in turn, their timed steps alternate (the order rotating each round), so both see the same load "
        "from other processes; the 7B's do not fit in memory together and run one after the other. Load: ours is `load_base(folder, quantize=(\"all-linear\", "
        f"\"{SCHEME}\"))` (each block Linear quantized to NF4 as it is read); theirs is `AutoModelForCausalLM."
        "from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
        "bnb_4bit_quant_type=\"nf4\", bnb_4bit_compute_dtype=X), device_map=\"cpu\", dtype=X)`. Training: "
        f"LoRA r {RANK}, alpha {ALPHA:g} on all-linear (lm_head excluded, both), {OPTIMIZER_NOTE} on the LoRA factors, "
        f"batch {BATCH} × {SEQ} random token ids. Compute dtype: fp32 = ours `build_for_training(..., "
        "precision=\"fp32\")` (the base's float parts cast to fp32) / theirs compute_dtype float32; bf16 = ours "
        "`precision=\"bf16\"` (minituner.precision: NF4 dequantized to bf16, bf16 products and attention, "
        "fp32 LoRA masters and norms, bf16 logits whose loss minigpt.cross_entropy computes in fp32 a few rows "
        "at a time) / theirs compute_dtype bfloat16 under torch.autocast(\"cpu\", bfloat16), its logits upcast "
        "to fp32 for the loss as transformers' ForCausalLMLoss does. 'step' is the median of the steps after the first (the first is shown apart); tokens/s = "
        "512 / step. Peak RSS is VmHWM, reset before loading and before the first step; 'baseline' is the RSS "
        "after the contender's imports. Planner: the load bound is `regime_bytes(load_config_shape(folder), "
        "Regime(\"qlora\", 16), \"all-linear\", MemoryConfig(dtype=\"bf16\"))`'s weights bucket (what is "
        "resident after loading) + the largest tensor + the baseline; the training figure is the peak of a "
        "step that `minituner memory-check` predicts for the run (planner/peak.py with the exact activation "
        "model, told the run's precision) + the baseline. MiB = 1024² bytes. The machine has 2 cores shared "
        "with other sessions: 'load avg' is the 1-minute "
        "load average when each subprocess started, and every figure moves with it.",
        ["shape", "contender", "compute", "load", "load CPU time", "load peak RSS (MiB)", "load bound (MiB)",
         "load peak / bound", "first step", "step", "tokens/s", "train peak RSS (MiB)", "planner peak + baseline (MiB)",
         "train peak / planner", "baseline (MiB)", "trainable params", "loss first → last", "load avg"],
    )
    by = {}
    for shape, rows in results.items():
        p = planner[shape]
        for r in rows:
            by[(shape, r["contender"], r["dtype"])] = r
            label = CONTENDERS[r["contender"]]
            if "error" in r:
                s.rows.append([SHORT[shape], label, DTYPES[r["dtype"]], "failed: " + r["error"][:120]] + [""] * 14)
                continue
            bound = p["load weights"] + p["largest"][1] + r["baseline_mib"]
            planned = p[DTYPES[r["dtype"]]]["peak"] + r["baseline_mib"]  # the planner's peak + this process's own
            step = statistics.median(r["step_times"]) if r["step_times"] else r["first_step_s"]  # 1 step: that one
            r.update(bound=bound, planned_peak=planned, step=step)
            s.rows.append([
                SHORT[shape], label, DTYPES[r["dtype"]], _fmt_s(r["load_s"]), _fmt_s(r["load_cpu_s"]),
                f"{r['load_peak_mib']:.0f}", f"{bound:.0f}", f"{r['load_peak_mib'] / bound:.2f}",
                _fmt_s(r["first_step_s"]),
                f"{_fmt_s(step)}" + {0: " (the first step alone)", 1: " (1 step)"}.get(
                    len(r["step_times"]), f" (median of {len(r['step_times'])})"),
                f"{SEQ * BATCH / step:.1f}", f"{r['train_peak_mib']:.0f}", f"{planned:.0f}",
                f"{r['train_peak_mib'] / planned:.2f}", f"{r['baseline_mib']:.0f}", f"{r['trainable_params']:,}",
                f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}" if r.get("losses") else "n/a",
                f"{r['loadavg_at_start']:.1f}",
            ])

    def ok(key) -> dict | None:
        r = by.get(key)
        return r if r is not None and "error" not in r else None

    for shape in results:
        p = planner[shape]
        for dtype in plan[shape][0]:
            r = ok((shape, "ours", dtype))
            if r:
                s.goals.append(Goal(
                    f"{SHORT[shape]} load ({DTYPES[dtype]} run): our peak RSS / (planner QLoRA weights + largest tensor + baseline)",
                    r["load_peak_mib"] / r["bound"], LOAD_GOAL, False,
                    f"planner weights {p['load weights']:.0f} MiB (NF4 block Linears + bf16 rest) + largest "
                    f"tensor {p['largest'][0]} {p['largest'][1]:.0f} MiB + baseline {r['baseline_mib']:.0f} MiB; "
                    f"RSS right after loading {r['rss_loaded_mib']:.0f} MiB (the rest of the peak is transient: one "
                    "tensor read and its quantization temporaries)"))
                break
    seven = "llama-2-7b"
    if seven in results:
        for dtype in plan[seven][0]:
            r, t = ok((seven, "ours", dtype)), ok((seven, "peft_bnb", dtype))
            if r:
                pl = planner[seven][DTYPES[dtype]]
                s.goals.append(Goal(
                    f"7B QLoRA ({DTYPES[dtype]}) trains here: our train peak RSS / (planner peak + baseline)",
                    r["train_peak_mib"] / r["planned_peak"], TRAIN_GOAL_7B, False,
                    f"planner peak {pl['peak']:.0f} MiB at '{pl['phase']}' (weights {pl['weights']:.0f}, activations "
                    f"saved for backward {pl['activations']:.0f}; planner/peak.py, as memory-check predicts this run) + "
                    f"baseline {r['baseline_mib']:.0f} MiB; RSS before the first step {r['rss_before_train_mib']:.0f} "
                    "MiB. Above the planner: transients it does not model and freed memory glibc keeps resident "
                    "(see the note on glibc's heap)"))
            if r and t:
                s.goals.append(Goal(
                    f"7B load + quantize: transformers + bitsandbytes load_in_4bit / ours ({DTYPES[dtype]} run)",
                    t["load_s"] / r["load_s"], LOAD_SPEED_GOAL_7B, True,
                    f"ours {_fmt_s(r['load_s'])} (CPU {_fmt_s(r['load_cpu_s'])}), theirs {_fmt_s(t['load_s'])} "
                    f"(CPU {_fmt_s(t['load_cpu_s'])}); both read the same 12.6 GB from a warm page cache and "
                    "quantize 6.5 G weights on 2 shared cores"))
            if t:
                s.notes.append(f"7B PEFT + bitsandbytes ({DTYPES[dtype]}) fits this machine: train peak RSS "
                               f"{t['train_peak_mib'] / 1024:.1f} GiB, load peak {t['load_peak_mib'] / 1024:.1f} GiB "
                               f"(of {_total_gib():.1f} GiB), both counting the mapped checkpoint pages it read "
                               "(see the note on file-backed pages)")
            elif by.get((seven, "peft_bnb", dtype)):
                s.notes.append(f"7B PEFT + bitsandbytes ({DTYPES[dtype]}) did not complete: "
                               f"{by[(seven, 'peft_bnb', dtype)]['error']}")
    one = "llama-3.2-1b"
    if one in results:
        for dtype in plan[one][0]:
            r, t = ok((one, "ours", dtype)), ok((one, "peft_bnb", dtype))
            if r and t:
                s.goals.append(Goal(
                    f"1B QLoRA step ({DTYPES[dtype]}): ours / PEFT + bitsandbytes", r["step"] / t["step"],
                    STEP_GOAL_1B, False,
                    f"ours {_fmt_s(r['step'])}, theirs {_fmt_s(t['step'])} "
                    f"({len(r['step_times'])} vs {len(t['step_times'])} timed steps after one untimed"
                    + (", the two processes' steps alternating" if r.get("paced") and t.get("paced") else "")
                    + f"); load average {r['loadavg_at_start']:.1f} / {t['loadavg_at_start']:.1f} when each started. "
                    + f"Both run {DTYPES[dtype]} products of the same shapes on NF4 weights dequantized per call, "
                    "which take most of the step at this shape (the bf16 section times the products of the step "
                    "alone), so a lead of 20% needs fewer or cheaper products, not less overhead"
                    + ". The products: " + (fp32_product_libraries() if dtype == "float32"
                                            else bf16_product_libraries())))
        if "bfloat16" not in plan[one][0] and not bf16_support("cpu").fast:
            s.goals.append(Goal(
                "1B QLoRA step (bf16): ours / PEFT + bitsandbytes", None, STEP_GOAL_1B, False,
                f"not measurable here: {bf16_support('cpu').reason}, where bf16 products run many times slower "
                "than fp32 ones (the bf16 section times one both ways), so this section ran fp32 only",
                measurable=False))
    for shape in results:
        base = ok((shape, "ours", "bfloat16")) or ok((shape, "ours", "float32"))
        plain, mm = (next((ok((shape, who, d)) for d in plan[shape][0] if ok((shape, who, d))), None)
                     for who in ("ours_no_trims", "ours_mmap"))
        if base and (plain or mm):
            def peak(r: dict) -> str:
                return (f"train peak RSS {r['train_peak_mib']:.0f} MiB ({r['train_peak_mib'] / r['planned_peak']:.2f}× "
                        f"the planner's peak + baseline), step {_fmt_s(r['step'])}")
            s.notes.append(
                f"{SHORT[shape]} ({DTYPES[base['dtype']]}), glibc's heap: by default glibc raises its mmap threshold "
                "after each large free, so activations then come from the heap, and the holes the forward's freed "
                "temporaries leave there stay resident. Ours as built (build_for_training on CPU gives the heap's free "
                "pages back with malloc_trim before every 8th block and before the head of a training forward, whenever "
                "at least 64 MiB of it lies free and resident, and otherwise keeps what a step frees for the next, glibc's mmap "
                "threshold fixed at 32 MiB and its own trimming off, "
                f"minituner.memory.heap): {peak(base)}"
                + (f"; without the trims: {peak(plain)}" if plain else "")
                + (f"; with glibc's mmap threshold fixed at 128 KiB instead (MALLOC_MMAP_THRESHOLD_=131072, which ours "
                   "then leaves as set; every "
                   f"large tensor a fresh mapping whose pages fault in and are zeroed on first touch): {peak(mm)}"
                   if mm else "")
                + ". `minituner memory-check` pins the threshold (to measure live tensors)")
        for dtype in plan[shape][0]:
            r, t = ok((shape, "ours", dtype)), ok((shape, "peft_bnb", dtype))
            if r and t and r.get("losses") and t.get("losses"):
                s.notes.append(f"{SHORT[shape]} {DTYPES[dtype]}: loss at step 0 ours {r['losses'][0]:.6f}, theirs "
                               f"{t['losses'][0]:.6f} (same weights, NF4 codes and LoRA B = 0: the same model)")
            for who in (r, t):
                if who and who.get("rss_anon_file_trained_mib"):
                    a, f = who["rss_anon_file_trained_mib"]
                    s.notes.append(f"{SHORT[shape]} {DTYPES[dtype]} {who['contender']}: after training, RSS = {a:.0f} MiB "
                                   f"anonymous + {f:.0f} MiB file-backed pages")
    s.notes.append("Before each contender runs, the bench reads the checkpoint's files once, so every load reads "
                   "them from the page cache: no contender pays for a cold read the others skip")
    s.notes.append("RSS counts file-backed pages a process maps: transformers keeps the checkpoint's shards mapped "
                   "(safetensors), so pages of it that were read count in PEFT + bitsandbytes' RSS (page cache, "
                   "reclaimable); our loader keeps no mapping (it copies what it keeps), so ours is anonymous memory")
    for shape, (secs, gib) in written.items():
        s.notes.append(f"{shape}: checkpoint of {gib:.2f} GiB written in {_fmt_s(secs)}; compute dtypes run: "
                       f"{', '.join(DTYPES[d] for d in plan[shape][0])}; timed steps after the first: {plan[shape][1]}")
    if seven in plan:
        s.notes.append(f"7B: {', '.join(DTYPES[d] for d in plan[seven][0])} only (a second compute dtype would "
                       f"double the section's time), {plan[seven][1]} timed step(s) after the first (0: the first step is the figure, with its one-off costs such as allocator "
                       "growth)")
    elif one in plan:
        s.notes.append("7B shape not run in this invocation (quick mode or --shapes)")
    s.notes.append("PEFT + bitsandbytes runs without prepare_model_for_kbit_training (it would turn on gradient "
                   "checkpointing and upcast the non-quantized weights to fp32), so both sides keep every "
                   "activation and the same float dtype")
    threads = {r.get("threads") for rows in results.values() for r in rows if "error" not in r}
    s.notes.append(f"torch threads per subprocess: {', '.join(str(t) for t in sorted(threads))}")
    return s


def _total_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contender", choices=list(CONTENDERS), help="run one contender (subprocess mode)")
    parser.add_argument("--folder")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=-1, help="timed steps after the first (-1: the plan's)")
    parser.add_argument("--paced", action="store_true", help="subprocess mode: timed steps on 'step' lines from stdin")
    parser.add_argument("--shapes", help=f"section mode: comma-separated of {list(PLAN)}")
    parser.add_argument("--dtypes", help="section mode: override the compute dtypes (comma-separated)")
    parser.add_argument("--out", type=Path, help="section mode: write a Markdown report here")
    parser.add_argument("--contenders", help=f"section mode: of {list(CONTENDERS)} (default: {list(DEFAULT_CONTENDERS)}, "
                        f"and for some shapes {SHAPE_CONTENDERS})")
    parser.add_argument("--from-logs", type=Path, nargs="+", help="render the section from earlier runs' stderr")
    args = parser.parse_args(argv)
    if args.contender:
        print(json.dumps(measure(args.contender, args.folder, args.dtype, max(0, args.steps), args.paced)))  # -1 -> 0
        return 0
    from minigpt.io import atomic_write_text
    from report import render
    from timing import machine_description

    shapes = [x for x in (args.shapes or ",".join(PLAN)).split(",") if x]
    default = plan_for(bf16_support("cpu").fast)
    plan = {sh: ((tuple(args.dtypes.split(",")) if args.dtypes else default[sh][0]), args.steps if args.steps >= 0
                 else default[sh][1]) for sh in shapes}
    machine = machine_description()
    if args.from_logs:  # the load average now says nothing about the runs; each subprocess's is in the table
        machine = [m for m in machine if not m.startswith("- Load average")] + [
            f"- Rendered from the logs of earlier runs ({', '.join(p.name for p in args.from_logs)}): the load "
            "average when each subprocess started is in the table ('load avg')"]
    t0 = time.perf_counter()
    sec = from_logs(args.from_logs) if args.from_logs else run(plan=plan, contenders=tuple(args.contenders.split(",")) if args.contenders else None)
    text = render(machine, [sec], "python benchmarks/bench_real_models.py " + " ".join(argv or sys.argv[1:]),
                  time.perf_counter() - t0)
    if args.out:
        atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

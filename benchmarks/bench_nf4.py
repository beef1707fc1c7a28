"""NF4 quantize and dequantize of a 4096×4096 matrix: ours against bitsandbytes, torchao and the memory floors.

Ours is checked byte for byte against bitsandbytes on the same matrix before anything is timed. Also
timed, as a record of what was tried: our eager PyTorch path (no compiler) and the same arithmetic
fused by torch.compile (inductor), which the native kernels replaced.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager

import torch

from miniquant import dequantize_nf4, native, nf4, quantize_nf4
from report import Goal, Section
from timing import MIB, fmt_ratio, fmt_seconds, time_call, time_interleaved

SHAPE = (4096, 4096)
BLOCKSIZE = 64
QUANTIZE_GOAL = 20.0  # bitsandbytes time / ours
DEQUANTIZE_GOAL = 1.5
# how each path of ours finds a value's code (miniquant/native.py; nf4.py for the eager path)
SEARCH = {"AVX-512": "a 4-step binary search over the 15 midpoints with AVX-512 permutes",
          "AVX2": "15 compares with the midpoints, 8 values at a time (AVX2)",
          "plain C": "15 compares with the midpoints in plain C, as the compiler vectorizes them",
          None: "the eager path's lookup-table search in PyTorch ops (no native kernels)"}


@contextmanager
def eager_path():
    """Force miniquant's eager PyTorch path (as on a machine without a C compiler)."""
    saved = nf4.NATIVE_MIN_ELEMENTS
    nf4.NATIVE_MIN_ELEMENTS = 1 << 62
    try:
        yield
    finally:
        nf4.NATIVE_MIN_ELEMENTS = saved


def eager(fn):
    def call():
        with eager_path():
            return fn()
    return call


# ---- the torch.compile alternative (measured, not used by the library) ---------------------------


def _compiled_quantize(x: torch.Tensor, mids: torch.Tensor):
    """(blocks, 64) -> packed, absmax: the eager arithmetic, 15 compares per value, for inductor to fuse."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    scaled = (xf * (1.0 / absmax.clamp(min=nf4.ABSMAX_FLOOR))[:, None]).clamp(-1.0, 1.0)
    pairs = scaled.view(x.shape[0], -1, 2)

    def code(v):
        c = (v > mids[0]).float()
        for k in range(1, 15):
            c = c + (v > mids[k]).float()
        return c

    return (code(pairs[..., 0]) * 16 + code(pairs[..., 1])).to(torch.uint8), absmax


def _compiled_dequantize(packed: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, dtype: torch.dtype):
    high, low = code[(packed >> 4).long()], code[(packed & 0xF).long()]
    return (torch.stack([high, low], dim=-1).view(packed.shape[0], -1) * scales[:, None]).to(dtype)


def _one_off_build_seconds() -> float | None:
    """Seconds to compile the native kernels into an empty cache (what the first use on a machine pays)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or native.kernels() is None:
        return None
    saved = os.environ.get(native.CACHE_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[native.CACHE_ENV] = tmp
        try:
            t0 = time.perf_counter()
            native._build(compiler)
            return time.perf_counter() - t0
        finally:
            if saved is None:
                os.environ.pop(native.CACHE_ENV)
            else:
                os.environ[native.CACHE_ENV] = saved


def _torchao_to_nf4():
    try:
        from torchao.quantization import to_nf4
    except Exception:  # not installed, or it fails to import against this torch
        return None
    return to_nf4


def run(quick: bool = False) -> Section:
    import bitsandbytes.functional as bnb

    repeats = 3 if quick else 15  # quantize rounds (bitsandbytes takes ~0.3 s a call); dequantize: 2x
    to_nf4 = _torchao_to_nf4()
    section = Section(
        "NF4 quantize and dequantize, 4096×4096",
        f"Blocks of {BLOCKSIZE}, no double quantization unless said. 'vs ours' is the row's median over ours "
        "(above 1: slower than ours). The floors copy the same bytes: the input for quantize, the output "
        "for dequantize, into an existing tensor (memory bandwidth) or a fresh one (allocation and page "
        "faults included, as any function returning a new tensor pays).",
        ["operation", "dtype", "implementation", "median", "first call", "vs ours"],
    )
    build_s = _one_off_build_seconds()
    kernels = native.kernels()
    section.notes.append(
        "native kernels: " + ("not available (no C compiler): ours is the eager path" if kernels is None else
                              f"C compiled once per machine and cached; the one-off build took {fmt_seconds(build_s)}; "
                              f"the path built for this CPU: {kernels.path}")
    )
    search = SEARCH[kernels.path if kernels else None]
    mids, code = nf4.nf4_midpoints(), nf4.nf4_code_table()
    cq = torch.compile(_compiled_quantize, dynamic=False)
    cd = torch.compile(_compiled_dequantize, dynamic=False)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
        out_same = torch.empty_like(w)
        q = quantize_nf4(w, BLOCKSIZE)
        packed, state = bnb.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type="nf4")
        if not (torch.equal(q.packed, packed.reshape(-1)) and torch.equal(q.absmax, state.absmax)):
            raise AssertionError(f"NF4 bytes differ from bitsandbytes on the {name} benchmark matrix")
        with eager_path():
            if not torch.equal(quantize_nf4(w, BLOCKSIZE).packed, q.packed):
                raise AssertionError("eager and native paths disagree")
        blocks = w.view(-1, BLOCKSIZE)
        t0 = time.perf_counter()
        cq_out = cq(blocks, mids)
        cq_compile = time.perf_counter() - t0
        if not torch.equal(cq_out[0].view(-1), q.packed):
            raise AssertionError("the torch.compile variant disagrees with ours")

        qt = time_interleaved({
            "ours": lambda: quantize_nf4(w, BLOCKSIZE),
            "bitsandbytes": lambda: bnb.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type="nf4"),
            "copy": lambda: out_same.copy_(w),
            "clone": lambda: w.clone(),
        }, repeats)
        extra = {
            "ours, double quant": time_call(lambda: quantize_nf4(w, BLOCKSIZE, double_quant=True), repeats),
            "ours, eager PyTorch path": time_call(eager(lambda: quantize_nf4(w, BLOCKSIZE)), max(3, repeats // 2)),
            "torch.compile of the same arithmetic": time_call(lambda: cq(blocks, mids), repeats),
        }
        extra["torch.compile of the same arithmetic"].first_s = cq_compile
        if to_nf4 is not None:
            extra["torchao to_nf4 (always double quant)"] = time_call(lambda: to_nf4(w, BLOCKSIZE, 256), 3, 1)
        ours = qt["ours"].median_s
        label = {"copy": "copy into an existing tensor (floor)", "clone": "clone into a fresh tensor"}
        for impl, t in [*qt.items(), *extra.items()]:
            section.rows.append(["quantize", name, label.get(impl, impl), t.fmt(), fmt_seconds(t.first_s),
                                 fmt_ratio(t.median_s / ours)])
        ratio = qt["bitsandbytes"].median_s / ours
        section.goals.append(Goal(
            f"NF4 quantize {name} 4096²: bitsandbytes time / ours", ratio, QUANTIZE_GOAL, True,
            f"ours takes {ours / qt['copy'].median_s:.1f}× a copy of the input into an existing tensor: per value "
            f"{search}, on "
            f"{torch.get_num_threads()} threads, plus a fresh output; bitsandbytes' CPU path is several PyTorch "
            "passes over float32 temporaries plus a bucketize",
        ))

        # dequantize
        out_fp = torch.empty(SHAPE, dtype=dtype)
        scales = q.absmax
        pk = q.packed.view(-1, BLOCKSIZE // 2)
        t0 = time.perf_counter()
        cd_out = cd(pk, scales, code, dtype)
        cd_compile = time.perf_counter() - t0
        d_ours = dequantize_nf4(q)
        if not torch.equal(cd_out.view(SHAPE), d_ours):
            raise AssertionError("the torch.compile dequantize disagrees with ours")
        d_bnb = bnb.dequantize_4bit(packed, state)
        dt = time_interleaved({
            "ours": lambda: dequantize_nf4(q),
            "bitsandbytes": lambda: bnb.dequantize_4bit(packed, state),
            "copy": lambda: out_fp.copy_(w),
            "clone": lambda: w.clone(),
        }, 2 * repeats)
        extra = {
            "ours, eager PyTorch path": time_call(eager(lambda: dequantize_nf4(q)), repeats),
            "torch.compile of the same arithmetic": time_call(lambda: cd(pk, scales, code, dtype), repeats),
        }
        extra["torch.compile of the same arithmetic"].first_s = cd_compile
        if to_nf4 is not None:
            tq = to_nf4(w, BLOCKSIZE, 256)
            extra["torchao get_original_weight"] = time_call(tq.get_original_weight, 3, 1)
        ours = dt["ours"].median_s
        for impl, t in [*dt.items(), *extra.items()]:
            section.rows.append(["dequantize", name, label.get(impl, impl), t.fmt(), fmt_seconds(t.first_s),
                                 fmt_ratio(t.median_s / ours)])
        out_mib = w.numel() * w.element_size() / MIB
        kernels = native.kernels()
        threads = (f"on {torch.get_num_threads()} threads of PyTorch's OpenMP team"
                   if kernels is not None and kernels.openmp and torch.get_num_threads() > 1
                   else "on one thread")
        section.goals.append(Goal(
            f"NF4 dequantize {name} 4096²: bitsandbytes time / ours", dt["bitsandbytes"].median_s / ours,
            DEQUANTIZE_GOAL, True,
            f"a fresh {out_mib:.0f} MiB output: ours takes {ours / dt['copy'].median_s:.2f}× a copy into an existing "
            f"tensor and {ours / dt['clone'].median_s:.2f}× a clone into a fresh one (page faults); it writes the "
            f"output once, {threads}, in 2 MiB pages where the OS grants them",
        ))
        diff = (d_bnb.float() - d_ours.float()).abs().max().item()
        section.notes.append(
            f"{name}: ours equals bitsandbytes' packed bytes and absmax exactly (checked before timing); dequantized "
            f"values here: max |ours − bitsandbytes.functional.dequantize_4bit| = {diff:.2e} (ours is code × absmax "
            "in float32, like bitsandbytes' pure-PyTorch backend; tests/miniquant/test_nf4_bnb.py records where its "
            "native CPU kernel differs)"
        )
    section.notes.append(
        "torch.compile (inductor, C++/OpenMP) of the same arithmetic is exact too, but it does not vectorize the "
        "16-entry code lookup or the nibble interleave; the native kernels (miniquant/native.py) have an AVX-512, "
        "an AVX2 and a plain-C path, built for the widest this CPU has (the first note says which). 'first call' of the "
        "torch.compile rows is its compile time."
    )
    if to_nf4 is None:
        section.notes.append("torchao is not installed: its rows are missing (pip install '.[bench]')")
    else:
        section.notes.append("torchao's NF4 uses its own layout and always double-quantizes the block scales "
                             "(its bytes are not bitsandbytes'); compare it with 'ours, double quant'")
    return section

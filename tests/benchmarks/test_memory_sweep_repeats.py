"""benchmarks/memory_sweep.py: a small point measured several times keeps its median run, whole, and says so."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import memory_sweep  # noqa: E402

MIB = memory_sweep.MIB


def _run(peak_mib: float, phase: str) -> dict:
    return {"predicted": {"peak": int(5.82 * MIB)}, "measured": {"peak": int(peak_mib * MIB)},
            "error": {"peak": 0.0},
            "details": {"model": "minigpt", "regime": "full", "rank": None, "batch_size": 8, "seq_len": 64,
                        "counted_targets": 512, "grad_checkpoint": True, "measured_peak_phase": phase}}


def test_median_run_keeps_the_middle_run_whole():
    runs = [_run(6.64, "a"), _run(5.90, "b"), _run(6.21, "c")]
    kept = memory_sweep.median_run(runs)
    assert kept["details"]["measured_peak_phase"] == "c"  # that run's own figures, not a mix
    assert kept["measured"]["peak"] == int(6.21 * MIB)
    assert kept["details"]["peak_runs"] == sorted(int(v * MIB) for v in (6.64, 5.90, 6.21))


def test_median_run_of_an_even_count_takes_the_lower_middle():
    kept = memory_sweep.median_run([_run(4.0, "a"), _run(3.0, "b"), _run(5.0, "c"), _run(6.0, "d")])
    assert kept["details"]["measured_peak_phase"] == "a"


def test_one_run_is_kept_as_it_is():
    run = _run(6.0, "a")
    assert memory_sweep.median_run([run]) is run
    assert "peak_runs" not in run["details"]
    assert memory_sweep.repeated([run]) == []


def test_repeated_names_each_points_measured_peaks():
    kept = memory_sweep.median_run([_run(6.64, "a"), _run(5.90, "b"), _run(6.21, "c")])
    (line,) = memory_sweep.repeated([kept, _run(12.0, "x")])
    assert "minigpt full 8 × 64, checkpointed: 5.90 / 6.21 / 6.64 (predicted 5.82)" in line
    assert f"ran {memory_sweep.REPEATS} times" in line

"""PHASE_28_REPORT.md is regenerated from the labs' committed results and must match byte for byte."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not all((ROOT / "experiments" / lab / "results.json").is_file() for lab in ("28-lora-finetune", "28-qlora-preview")),
    reason="Labs 02 and 03 have not been run")


@pytest.fixture(scope="module")
def phase28():
    spec = importlib.util.spec_from_file_location("phase28_report", ROOT / "experiments" / "phase28_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_is_up_to_date(phase28):
    text = phase28.render(phase28.load_results())
    assert (ROOT / "PHASE_28_REPORT.md").read_text(encoding="utf-8") == text, "run python experiments/phase28_report.py"


def test_page_links_every_lab_report_and_plot(phase28, tmp_path):
    assert phase28.main(["--out", str(tmp_path / "page.md")]) == 0
    text = (tmp_path / "page.md").read_text(encoding="utf-8")
    for link in ("28-lora-counts/REPORT.md", "28-lora-counts/memory_breakdown.png", "28-lora-finetune/REPORT.md",
                 "28-lora-finetune/loss_curve.png", "28-qlora-preview/REPORT.md", "28-qlora-preview/loss_curve.png"):
        assert f"(experiments/{link})" in text and (ROOT / "experiments" / link).is_file(), link

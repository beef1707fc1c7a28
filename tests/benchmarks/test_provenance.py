"""benchmarks/provenance.py: a run names the commit it measured, and the kept reports of other kinds the code
each of them ran."""
import importlib.util
import subprocess
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "provenance", Path(__file__).resolve().parents[2] / "benchmarks" / "provenance.py")
provenance = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(provenance)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "src.py").write_text("x = 1\n")
    _git(tmp_path, "add", "src.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def _head(root: Path) -> str:
    return _git(root, "rev-parse", "--short=12", "HEAD")


def test_a_clean_tree_names_its_commit(repo):
    line = provenance.code_line(repo)
    assert line.startswith("- Code: git commit " + _head(repo))
    assert line.endswith("no uncommitted changes outside the reports")


def test_the_reports_a_run_writes_do_not_count_as_changed_code(repo):
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "RESULTS.md").write_text("a run\n")
    (repo / "benchmarks" / "results" / "cpu.md").write_text("a run\n")
    assert provenance.code_line(repo).endswith("no uncommitted changes outside the reports")


def test_changed_and_new_files_are_named(repo):
    (repo / "src.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    line = provenance.code_line(repo)
    assert "with uncommitted changes, measured here too: " in line
    assert "src.py" in line and "new.py" in line


def test_many_changes_are_counted_past_the_first_few(repo):
    for i in range(provenance.SHOWN_CHANGES + 2):
        (repo / f"f{i}.py").write_text("")
    assert provenance.code_line(repo).endswith(" and 2 more")


def test_outside_a_checkout_it_says_so(tmp_path):
    assert "not a git checkout" in provenance.code_line(tmp_path)


def test_a_kept_report_names_the_code_it_recorded(repo):
    report = repo / "benchmarks" / "results" / "cpu.md"
    report.parent.mkdir(parents=True)
    report.write_text("# Benchmarks\n- CPU: x\n- Code: git commit 0123456789ab (2026-12-07); with uncommitted changes, "
                      "measured here too: a.py\n")
    assert provenance.kept_run(report, repo) == ("results/cpu.md (code: git commit 0123456789ab (2026-12-07) with "
                                                 "uncommitted changes)")
    report.write_text("- Code: git commit 0123456789ab (2026-12-07); no uncommitted changes outside the reports\n")
    assert provenance.kept_run(report, repo) == "results/cpu.md (code: git commit 0123456789ab (2026-12-07))"


def test_an_older_report_points_to_the_commit_that_wrote_it(repo):
    report = repo / "benchmarks" / "results" / "cpu.md"
    report.parent.mkdir(parents=True)
    report.write_text("# Benchmarks\n- CPU: x\n")
    assert provenance.kept_run(report, repo) == "results/cpu.md (code not recorded, nor the report committed)"
    _git(repo, "add", str(report))
    _git(repo, "commit", "-q", "-m", "make bench")
    written = provenance.kept_run(report, repo)
    assert written.startswith(f"results/cpu.md (code not recorded; the report committed in {_head(repo)} on ")

"""Which code a benchmark run measured: the git commit it ran at, and which runs the other kinds' reports hold.

    code_line(root)            # '- Code: git commit 1a2b3c4d5e6f (2026-12-07); no uncommitted changes ...'
    kept_run(path, root)       # 'results/x.md (code: git commit ...)' or, for a report without a code line,
                               # '(code not recorded; the report committed in 1a2b3c4d5e6f on 2026-12-06)'

benchmarks/results/ keeps the latest full run on each kind of machine side by side, and the runs are of different
code: one kind's report may predate a kernel that another's measured. Each run names its commit in its machine
section (``code_line``: the work tree's changes outside the reports named too, as they are measured but not in
the commit), and the pointer to the other kinds' reports says which code each of them ran
(``kept_run``: its own code line; for a report written before runs recorded it, the commit that last wrote the
file, whose message names the code it ran). Outside a git checkout, or without git, they say so.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

CODE_PREFIX = "- Code: "
# what a run writes itself: its own uncommitted reports do not change the code it measures
REPORT_PATHS = ("benchmarks/RESULTS.md", "benchmarks/results")
SHOWN_CHANGES = 5  # changed paths named in the code line; more are counted


def _git(root: Path, *args: str) -> str | None:
    """git's output in root (trailing whitespace stripped: a status line starts with a space); None where git is
    missing or the command fails (not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def _changed_paths(root: Path) -> list[str]:
    """Paths with uncommitted changes (untracked ones included), the reports a run writes left out."""
    status = _git(root, "status", "--porcelain", "--untracked-files=all", "--", ".",
                  *(f":(exclude){p}" for p in REPORT_PATHS))
    return [line[3:] for line in (status or "").splitlines() if line.strip()]


def code_line(root: Path) -> str:
    """The machine section's line naming the code this run measures: the commit checked out in root and the work
    tree's uncommitted changes, outside the reports a run writes (the first SHOWN_CHANGES named)."""
    commit = _git(root, "log", "-1", "--format=%h %cs", "--abbrev=12")
    if not commit:
        return CODE_PREFIX + "not a git checkout, or git is missing (no commit to name)"
    sha, date = commit.split()
    changed = _changed_paths(root)
    if not changed:
        tree = "no uncommitted changes outside the reports"
    else:
        named = ", ".join(changed[:SHOWN_CHANGES]) + (f" and {len(changed) - SHOWN_CHANGES} more"
                                                       if len(changed) > SHOWN_CHANGES else "")
        tree = f"with uncommitted changes, measured here too: {named}"
    return f"{CODE_PREFIX}git commit {sha} ({date}); {tree}"


def kept_run(path: Path, root: Path) -> str:
    """'results/<name> (code: ...)': a kept report and the code it ran, from its own code line, else (a report
    written before runs recorded one) the commit that last wrote the file, whose message names that code."""
    label = f"{path.parent.name}/{path.name}"
    try:
        recorded = next((line[len(CODE_PREFIX):] for line in path.read_text().splitlines()
                         if line.startswith(CODE_PREFIX)), None)
    except OSError:
        recorded = None
    if recorded is not None:
        commit, _, tree = recorded.partition(";")
        dirty = " with uncommitted changes" if "uncommitted changes," in tree else ""
        return f"{label} (code: {commit}{dirty})"
    written = _git(root, "log", "-1", "--format=%h %cs", "--abbrev=12", "--", str(path.resolve()))
    if written:
        sha, date = written.split()
        return f"{label} (code not recorded; the report committed in {sha} on {date})"
    return f"{label} (code not recorded, nor the report committed)"

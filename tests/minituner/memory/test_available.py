"""The memory finetune's plan compares against: the system's, capped by a cgroup's memory limit (a container)."""
from __future__ import annotations

from pathlib import Path

import psutil

from minituner.memory.available import available_memory, cgroup_headroom
from minituner.memory.run_plan import describe_run_plan

GIB = 2**30


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)


def test_v2_limit_counts_usage_without_inactive_files(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    root = tmp_path / "fs"
    _write(root / "user.slice" / "job", memory__max=str(4 * GIB), memory__current=str(3 * GIB),
           memory__stat=f"anon 123\ninactive_file {GIB}\nactive_file 5\n")
    _write(root / "user.slice", memory__max="max", memory__current=str(9 * GIB))
    assert cgroup_headroom(proc, root) == (2 * GIB, root / "user.slice" / "job")  # 4 - (3 - 1) GiB


def test_the_tightest_group_above_wins(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    root = tmp_path / "fs"
    _write(root / "a" / "b", memory__max=str(8 * GIB), memory__current=str(GIB))
    _write(root / "a", memory__max=str(3 * GIB), memory__current=str(2 * GIB))
    assert cgroup_headroom(proc, root) == (GIB, root / "a")


def test_v1_and_a_namespace_whose_root_is_the_group(tmp_path):
    """v1's memory controller; the path /proc/self/cgroup names is not under the mount (a cgroup namespace shows
    the container's group as the root), so the mount's root files are read."""
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory", memory__limit_in_bytes=str(2 * GIB), memory__usage_in_bytes=str(GIB // 2),
           memory__stat=f"cache 7\ntotal_inactive_file {GIB // 4}\n")
    assert cgroup_headroom(proc, root) == (2 * GIB - GIB // 4, root / "memory")
    _write(root / "memory", memory__limit_in_bytes=str(9223372036854771712))  # v1's "no limit"
    assert cgroup_headroom(proc, root) is None


def test_no_cgroup_leaves_the_system_figure(tmp_path):
    assert cgroup_headroom(tmp_path / "missing", tmp_path) is None
    available = available_memory(tmp_path / "missing", tmp_path)
    assert available.limit == "the system's"
    assert abs(available.bytes - psutil.virtual_memory().available) < GIB  # read a moment apart


def test_a_limit_below_the_system_caps_it_and_the_plan_says_so(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    _write(tmp_path / "fs", memory__max=str(GIB), memory__current="0")
    available = available_memory(proc, tmp_path / "fs")
    assert available.bytes == GIB and available.limit == f"the cgroup memory limit of {tmp_path / 'fs'}"
    plan = {"peak": 3 * GIB, "weights": GIB, "peak_phase": "backward: loss", "batch_size": 2, "seq_len": 8,
            "counted_targets": 16, "available_bytes": available.bytes, "available_limit": available.limit}
    line, warning = describe_run_plan(plan, "")
    assert line.endswith(f"1.0 GiB available now under the cgroup memory limit of {tmp_path / 'fs'}")
    assert warning.startswith("warning: the planned peak, beyond the weights already loaded, exceeds the memory "
                              f"available now under the cgroup memory limit of {tmp_path / 'fs'}: lower")


def test_unreadable_or_odd_files_are_no_limit(tmp_path, monkeypatch):
    """A folder the user may not enter, a memory.stat line that is not 'key value': no limit read, nothing raised."""
    proc = tmp_path / "cgroup"
    proc.write_text("garbage line\n0::/locked/job\n")
    root = tmp_path / "fs"
    _write(root, memory__max=str(GIB), memory__current=str(GIB // 2), memory__stat="inactive_file\nfoo bar baz\n")
    real_is_dir = Path.is_dir

    def is_dir(self):
        if self.name == "job":
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir)
    assert cgroup_headroom(proc, root) == (GIB // 2, root)  # the mount's own files, the stat ignored

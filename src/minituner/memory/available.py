"""The memory this process can still take: what the system has available (psutil), capped by the memory limit of
the control group it runs in, a container's limit, which psutil does not see.

The cap is the smallest headroom of the process's memory cgroup and every cgroup above it that sets a limit:
limit minus usage, where usage leaves out the page cache the kernel can drop (inactive files), as ``docker stats``
counts it. cgroup v2: ``memory.max``, ``memory.current`` and ``inactive_file`` in ``memory.stat``; v1:
``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file``. The group's path comes from
``/proc/self/cgroup``; inside a cgroup namespace (a container) the mount's root is the group itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

NO_LIMIT = 1 << 62  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Available:
    bytes: int
    limit: str  # where the figure comes from: "the system's" or "the cgroup memory limit of <group>"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a folder this user may not enter
        return False


def _groups(proc_cgroup: Path, root: Path) -> list[tuple[Path, tuple[str, str, str]]]:
    """(the process's memory cgroup folder, the file names to read in it) for v2 and v1, as /proc/self/cgroup says."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2, the unified hierarchy
            found.append((root, path, ("memory.max", "memory.current", "inactive_file")))
        elif "memory" in controllers.split(","):  # v1's memory controller
            found.append((root / "memory", path, ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                   "total_inactive_file")))
    return [(mount / path.lstrip("/") if _is_dir(mount / path.lstrip("/")) else mount, names)
            for mount, path, names in found]


def cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> tuple[int, Path] | None:
    """(bytes left under the tightest memory limit, its cgroup folder), or None where no cgroup sets one."""
    best: tuple[int, Path] | None = None
    for folder, (limit_file, usage_file, inactive_key) in _groups(proc_cgroup, root):
        mount = root if limit_file == "memory.max" else root / "memory"
        for group in [folder, *folder.parents]:
            limit = _read_int(group / limit_file)
            if limit is not None and limit < NO_LIMIT:
                used = (_read_int(group / usage_file) or 0) - _stat(group / "memory.stat", inactive_key)
                room = max(0, limit - max(0, used))
                if best is None or room < best[0]:
                    best = (room, group)
            if group == mount:
                break
    return best


def available_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> Available:
    """What psutil says is available, or less where a cgroup's memory limit leaves less."""
    system = psutil.virtual_memory().available
    capped = cgroup_headroom(proc_cgroup, root)
    if capped is not None and capped[0] < system:
        return Available(capped[0], f"the cgroup memory limit of {capped[1]}")
    return Available(system, "the system's")

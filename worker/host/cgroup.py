"""What this process's cgroup allows it: CPUs per period, and the memory left under a limit.

A limit set anywhere on the process's path to the root applies, so each reader takes the
tightest one on the path, in cgroup v2 (one unified hierarchy) or v1 (one per controller).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
_V1_NO_LIMIT = 1 << 60  # v1 reports "no limit" as a page-rounded 2^63 - 1

Read = Callable[[Path], float | None]


def cgroup_cpu_quota(root: Path = ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """CPUs this process's cgroup may use per period (the smallest quota on its path to the
    root; cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`); None for none."""
    quotas = _on_path("cpu", _v1_quota, _v2_quota, root, membership)
    return min(quotas) if quotas else None


def cgroup_memory_room(root: Path = ROOT, membership: Path = MEMBERSHIP) -> int | None:
    """Bytes this process's cgroup may still allocate: the smallest limit on its path less
    that cgroup's working set (its usage without the inactive file cache the kernel reclaims
    first); v2 `memory.max`/`memory.current`, v1 `memory.limit_in_bytes`/`usage_in_bytes`.
    None where no limit is set."""
    rooms = _on_path("memory", _v1_memory_room, _v2_memory_room, root, membership)
    return int(max(0, min(rooms))) if rooms else None


def _on_path(controller: str, read_v1: Read, read_v2: Read, root: Path,
             membership: Path) -> list[float]:
    """Every value `read_v1`/`read_v2` finds on this process's path in `controller`'s
    hierarchies (v1, including co-mounts such as `cpu,cpuacct`) and the unified one (v2)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    found: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            for base in (root, root / "unified"):
                found += _walk(base, path, read_v2)
        elif controller in controllers.split(","):
            found += _walk(root / controllers, path, read_v1)
            if controllers != controller:
                found += _walk(root / controller, path, read_v1)
    return found


def _walk(base: Path, path: str, read: Read) -> list[float]:
    """The values set on `path` and its ancestors under `base` (a container sees its own
    cgroup as the root: a path missing under `base` still has base's own files)."""
    found, parts = [], [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        value = read(base.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found


def _v2_quota(directory: Path) -> float | None:
    try:
        limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if limit == "max" else int(limit) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        limit = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 or period <= 0 else limit / period


def _v2_memory_room(directory: Path) -> float | None:
    return _memory_room(directory, "memory.max", "memory.current", "inactive_file")


def _v1_memory_room(directory: Path) -> float | None:
    return _memory_room(directory, "memory.limit_in_bytes", "memory.usage_in_bytes",
                        "total_inactive_file")


def _memory_room(directory: Path, limit_file: str, usage_file: str,
                 inactive_key: str) -> float | None:
    try:
        limit = (directory / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= _V1_NO_LIMIT:
            return None
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    return int(limit) - usage + _stat(directory, inactive_key)


def _stat(directory: Path, key: str) -> int:
    """One counter of the cgroup's memory.stat (0 where absent)."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0

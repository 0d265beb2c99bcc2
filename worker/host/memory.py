"""The memory this host can still give a worker: what the kernel reports available, capped
by a cgroup memory limit on the process's path and by `DELTASERVE_MEMORY_LIMIT`."""
from __future__ import annotations

import os

import psutil

from worker.host.cgroup import cgroup_memory_room

LIMIT_ENV = "DELTASERVE_MEMORY_LIMIT"  # bytes: the most this host is taken to have available


def available_memory() -> tuple[int, str]:
    """(bytes, where the figure comes from): the smallest of psutil's available memory, the
    room under a cgroup memory limit, and `DELTASERVE_MEMORY_LIMIT` where set (a host that
    keeps memory for other work, or a test that wants a small host)."""
    figures = [(psutil.virtual_memory().available, "available memory")]
    if (room := cgroup_memory_room()) is not None:
        figures.append((room, "room under the cgroup memory limit"))
    if (cap := os.environ.get(LIMIT_ENV, "").strip()):
        if not cap.isdigit():
            raise ValueError(f"{LIMIT_ENV} must be a number of bytes, got {cap!r}")
        figures.append((int(cap), LIMIT_ENV))
    return min(figures)

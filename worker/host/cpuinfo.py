"""The CPU's feature flags as Linux lists them (/proc/cpuinfo)."""
from __future__ import annotations

import functools


@functools.cache
def cpuinfo_flags() -> frozenset[str]:
    """The first processor's `flags` (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()

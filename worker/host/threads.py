"""How many threads a worker rank runs, and on which cores: the cores this process may use
(its affinity mask and its cgroup's CPU quota), divided among the ranks of this host.

In order of precedence:
  1. `--num-threads N` (`num_threads`);
  2. `VLLM_CPU_OMP_THREADS_BIND`, as vLLM reads it: CPU lists per local rank separated by
     `|` (`0-3|4-7`): the rank's threads are pinned one per listed CPU, as many as listed;
     `all`/`nobind` pin nothing; `auto` (the default) follows the mask (vLLM's `auto` pins
     to NUMA nodes), pinning only as 4. says, so a neighbour on one core is not a wall;
  3. `OMP_NUM_THREADS` when set (a test runner, or someone sharing the host on purpose);
  4. the usable CPUs (affinity mask, capped by the quota rounded up, as Java and Go count a
     quota) divided among the ranks on this host, at least 1. When the ranks exactly fill
     the mask (tensor parallel 2 on 2 CPUs, no quota below it) each rank's one thread is
     pinned to its own CPU: unpinned, a CPU-bound neighbour and the two ranks (which wait
     for each other at every all-reduce) shared the cores worse; pinned, only the neighbour
     moves (TP=2 SmolLM2 beside one: 28.1 vs 24.7 tok/s, quiet 64.3 vs 60.7;
     benchmarks/bench_contention.py, README "On a shared host").
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from worker.host.cgroup import cgroup_cpu_quota

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_NO_BIND = ("", "auto", "all", "nobind")


@dataclass(frozen=True)
class ThreadPlan:
    num_threads: int
    reason: str  # why, for the startup line
    bind: tuple[int, ...] | None = None  # a CPU per thread to pin it to (None: not pinned)
    adaptive: bool = False  # counted from the host (not set by the user): may follow its load

    def describe(self) -> str:
        cpus = "CPU" if self.bind and len(self.bind) == 1 else "CPUs"
        pinned = f", pinned to {cpus} {format_cpu_list(self.bind)}" if self.bind else ""
        return f"{self.num_threads} thread{'s' * (self.num_threads != 1)} ({self.reason}{pinned})"


def plan_threads(configured: int | None, ranks_here: int, local_index: int,
                 env: Mapping[str, str] = os.environ, cpus: set[int] | None = None,
                 quota: float | None = None, read_quota: bool = True) -> ThreadPlan:
    """The plan of the `local_index`-th of `ranks_here` ranks on this host (see the module
    docstring). `cpus`/`quota` default to this process's affinity mask and cgroup quota."""
    if configured:
        return ThreadPlan(configured, "--num-threads")
    bind = env.get(BIND_ENV, "").strip()
    if bind.lower() not in _NO_BIND:
        parts = bind.split("|")
        if local_index >= len(parts):
            raise ValueError(f"{BIND_ENV}={bind!r} lists CPUs for {len(parts)} ranks; local "
                             f"rank {local_index} has none")
        listed = parse_cpu_list(parts[local_index])
        return ThreadPlan(len(listed), f"{BIND_ENV}", tuple(listed))
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadPlan(int(omp), "$OMP_NUM_THREADS")
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    quota = cgroup_cpu_quota() if quota is None and read_quota else quota
    usable, why = len(cpus), f"{len(cpus)} CPUs in the affinity mask"
    if quota is not None:
        why += f", cgroup quota {quota:g} CPUs"
        usable = max(1, min(usable, math.ceil(quota - 1e-9)))
    if ranks_here > 1:
        why += f" / {ranks_here} ranks on this host"
    if ranks_here > 1 and usable == len(cpus) == ranks_here and bind.lower() in ("", "auto"):
        return ThreadPlan(1, why + ", a CPU each", (sorted(cpus)[local_index],))
    return ThreadPlan(max(1, usable // max(1, ranks_here)), why, adaptive=True)


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` -> [0, 1, 2, 3, 8, 10, 11] (Linux's cpu list format)."""
    cpus: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{BIND_ENV}: {text!r} is not a CPU list like 0-3,8") from None
    if not cpus or len(set(cpus)) != len(cpus) or min(cpus) < 0:
        raise ValueError(f"{BIND_ENV}: {text!r} must list distinct CPUs")
    return cpus


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and ranges[-1].split("-")[-1] == str(cpu - 1):
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)

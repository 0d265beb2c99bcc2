"""A CPU worker's start: its threads (and their pinning) as worker/host/threads.py plans
them, the sizer that adapts the team to other processes' load (worker/host/team_size.py),
and the line that says what was chosen and why."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from common.log_limiter import LogLimiter
from protocol import EngineConfig
from worker.host import amx, malloc, openmp
from worker.host.load_meter import LoadMeter, engine_pids
from worker.host.team_size import TeamSizer
from worker.host.threads import ThreadPlan, plan_threads

logger = logging.getLogger("deltaserve")
ADAPTIVE_ENV = "DELTASERVE_ADAPTIVE_THREADS"


@dataclass
class HostSetup:
    description: str  # for the workers-ready line
    sizer: TeamSizer | None  # None: the team keeps its size
    log: LogLimiter
    threads: int = 0  # the team size set last

    def before_step(self, rows: int) -> None:
        """Set the team size for a step of `rows` token rows (the sizer may try another
        size when other processes' load suggests one)."""
        if self.sizer is not None:
            size = self.sizer.before_step(rows)
            if size != self.threads:
                torch.set_num_threads(size)
                self.threads = size

    def after_send(self) -> None:
        """The step's answer is sent: the sizer's reading of /proc for the next step."""
        if self.sizer is not None:
            self.sizer.after_send()

    def after_step(self, rows: int, seconds: float) -> None:
        if self.sizer is not None and rows:
            before = self.sizer.current
            self.sizer.after_step(rows, seconds)
            if self.sizer.current != before:
                core = (" and the engine core schedules beside each step"
                        if self.sizer.reserved else "")
                self.log.info(f"{self.sizer.current} thread"
                              f"{'s' * (self.sizer.current != 1)} of "
                              f"{self.sizer.max_threads}: faster while other processes use "
                              f"{self.sizer.load.others:.1f} of {len(self.sizer.load.cpus)} "
                              f"CPUs{core}")


def ranks_on_this_host(config: EngineConfig, rank: int) -> tuple[int, int]:
    """(how many worker ranks share this host, this rank's index among them): the ranks
    the engine starts itself (all, or `local_ranks`) of every data-parallel replica; a rank
    that joined from elsewhere counts the other joined ranks."""
    world = config.tensor_parallel_size
    local = list(range(world)) if config.local_ranks is None else sorted(config.local_ranks)
    if rank not in local:
        local = sorted(set(range(world)) - set(local))
    replica = config.data_parallel_rank % config.data_parallel_size
    return len(local) * config.data_parallel_size, replica * len(local) + local.index(rank)


def engine_core_reserve(config: EngineConfig, ranks_here: int) -> float:
    """CPUs a rank's team leaves to its engine core: under async scheduling the core
    schedules step n + 1 while the workers run step n, so beside every step it takes a CPU
    (shared by the replica's ranks on this host). A spinning team that loses a CPU to it
    stalls at each barrier: TP=1 async steps on a 2-CPU host took 2.70 ms at 2 threads and
    2.11 at the one thread the sizer tries and keeps (sync 2.99; benchmarks/bench_engine.py,
    README). Sync scheduling: the core waits for the step (0)."""
    if not config.async_scheduling:
        return 0.0
    return 1.0 / max(1, ranks_here // config.data_parallel_size)


def set_up_host(config: EngineConfig, rank: int) -> HostSetup:
    """Set this process's threads (and malloc, worker/host/malloc.py); how the host was set
    up."""
    malloc.keep_freed_memory()
    ranks_here, index = ranks_on_this_host(config, rank)
    plan: ThreadPlan = plan_threads(config.num_threads, ranks_here, index)
    torch.set_num_threads(plan.num_threads)
    if plan.bind:
        from worker.native.cpu_threads import bind_threads
        bind_threads(plan.bind)
    sizer = None
    if plan.adaptive and plan.num_threads > 1 and os.environ.get(ADAPTIVE_ENV, "1") != "0":
        sizer = TeamSizer(plan.num_threads, LoadMeter(frozenset(os.sched_getaffinity(0)),
                                                      ours=engine_pids()),
                          reserved=engine_core_reserve(config, ranks_here))
    adapts = ", fewer while other processes use the CPUs" if sizer else ""
    return HostSetup(f"{plan.describe()}{adapts}; {openmp.describe()}; "
                     f"{amx.describe(amx.this_process())}", sizer,
                     LogLimiter(logger, f"worker_{rank}", first=20, every=100), plan.num_threads)

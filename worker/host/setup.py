"""A CPU worker's start: its threads (and their pinning) as worker/host/threads.py plans
them, and the line that says what was chosen and why."""
from __future__ import annotations

import torch

from protocol import EngineConfig
from worker.host import amx
from worker.host.threads import ThreadPlan, plan_threads


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


def set_up_host(config: EngineConfig, rank: int) -> str:
    """Set this process's threads; the startup line's description of the host."""
    plan: ThreadPlan = plan_threads(config.num_threads, *ranks_on_this_host(config, rank))
    torch.set_num_threads(plan.num_threads)
    if plan.bind:
        from worker.native.cpu_threads import bind_threads
        bind_threads(plan.bind)
    return f"{plan.describe()}; {amx.describe(amx.this_process())}"

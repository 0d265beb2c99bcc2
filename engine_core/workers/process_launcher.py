"""The mp backend: each rank the engine starts itself is a local child process."""
from __future__ import annotations

import os

from common.process import spawn, stop_processes
from engine_core.workers.worker_failure import LocalWorker


class ProcessLauncher:
    """Starts `python -m worker` per rank; the engine core's children, stopped with it."""

    def __init__(self, world_size: int, spawned_ranks: list[int]) -> None:
        self.world_size = world_size
        self.spawned_ranks = spawned_ranks
        self.workers: dict[int, LocalWorker] = {}

    def default_address(self, runtime_dir: str) -> str:
        """A private ipc socket: nothing listens on the network."""
        return f"ipc://{runtime_dir}/workers"

    def ranks_are_local(self, address: str) -> bool:
        """Every rank is our child on this host (then they meet through a file)."""
        return len(self.spawned_ranks) == self.world_size

    def launch(self, address: str, env: dict[str, str]) -> dict[int, LocalWorker]:
        for rank in self.spawned_ranks:
            proc = spawn("worker", ["--connect", address, "--rank", str(rank)], env)
            self.workers[rank] = LocalWorker(rank, proc)
        return self.workers

    def stop(self) -> None:
        stop_processes([w.proc for w in self.workers.values()])

    def kill(self) -> None:
        """Last resort (the engine core's parent is gone): SIGKILL at once."""
        for worker in self.workers.values():
            try:
                os.kill(worker.proc.pid, 9)
            except OSError:
                pass

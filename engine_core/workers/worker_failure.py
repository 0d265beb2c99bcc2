"""How the engine core tells that a worker failed, died or hangs."""
from __future__ import annotations

import subprocess

import psutil

from common.process import describe_exit


class WorkerFailure(RuntimeError):
    """A worker failed, died or hangs; `process` names it (e.g. "worker_1"). `reported` marks
    a failure the worker described itself (a WorkerError)."""

    def __init__(self, process: str, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.process = process
        self.reported = reported


class LocalWorker:
    """A worker process this engine core started: is it gone, or stopped (SIGSTOP, a
    debugger)? A stopped process never answers, so it counts as failed."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank = rank
        self.proc = proc
        self._ps = psutil.Process(proc.pid)

    @property
    def name(self) -> str:
        return f"worker_{self.rank}"

    def state(self) -> str:
        """psutil's status ("running", "sleeping", "stopped", ...) or "gone"."""
        try:
            return self._ps.status()
        except psutil.NoSuchProcess:
            return "gone"

    def failure(self) -> WorkerFailure | None:
        if self.proc.poll() is not None:
            return WorkerFailure(self.name, f"{self.name} (pid {self.proc.pid}) "
                                            f"{describe_exit(self.proc.returncode)}")
        state = self.state()
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return WorkerFailure(self.name, f"{self.name} (pid {self.proc.pid}) is {state} "
                                            "and cannot make progress")
        return None

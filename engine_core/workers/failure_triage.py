"""Which worker failed, in its own words where it sent them: a failure often surfaces first
as a symptom (a socket disconnect, a process exit, a collective failing on a survivor)."""
from __future__ import annotations

import time

import zmq

from engine_core.workers.worker_failure import WorkerFailure
from protocol import WorkerError


class FailureTriage:
    """`WorkerGroup`'s failure reports. Needs `socket`, `peers`, `local`, `address` and
    `started`."""

    def check_alive(self) -> None:
        """Raise a WorkerFailure if a local worker has exited or is stopped, with its own
        report if one is queued."""
        dead = self._dead_worker()
        if dead is not None:
            raise self._blame(dead)

    def _dead_worker(self) -> WorkerFailure | None:
        return next((f for f in (w.failure() for w in self.local.values()) if f), None)

    def _failure_of(self, error: WorkerError, identity: bytes | None) -> WorkerFailure:
        rank = self.socket.rank_of(identity)
        when = f"at step {error.step}" if self.started else "to start"
        return WorkerFailure(f"worker_{rank}", f"worker_{rank} failed {when}: {error.message}",
                             True)

    def _blame(self, symptom: WorkerFailure, grace_s: float = 0.3) -> WorkerFailure:
        """A failure often surfaces first as a symptom: a socket disconnect, a process exit,
        or a collective failing on a survivor. Blame a local process that turns out to be
        dead or stopped, in its own words if it sent a WorkerError; else the first report;
        else the symptom."""
        reports = {symptom.process: symptom} if symptom.reported else {}
        deadline = time.monotonic() + grace_s
        while True:
            self._collect_reports(reports, 20)
            dead = self._dead_worker()
            if dead is not None:
                self._collect_reports(reports, 100)
                return reports.get(dead.process, dead)
            if time.monotonic() > deadline:
                return next(iter(reports.values()), symptom)

    def _collect_reports(self, reports: dict[str, WorkerFailure], timeout_ms: int) -> None:
        """Read queued frames (waiting up to the timeout for each) into `reports` if they are
        WorkerErrors, else keep them for `_receive`: a false alarm must lose nothing."""
        kept = []
        while self.socket.socket.poll(timeout_ms, zmq.POLLIN):
            message, identity = self.socket.read()
            if isinstance(message, WorkerError):
                failure = self._failure_of(message, identity)
                reports.setdefault(failure.process, failure)
            elif message is not None:
                kept.append((message, identity))
        self.socket.held.extend(kept)

    def _on_disconnect(self) -> None:
        """Some peer left. Raise if it was a worker: a worker that is gone is no longer
        routable (ROUTER_MANDATORY refuses a ping to it); anyone else is a stranger."""
        gone = [rank for rank, identity in self.peers.items()
                if not self.socket.reachable(identity)]
        if gone:
            name = f"worker_{gone[0]}"
            raise self._blame(WorkerFailure(name, f"{name} disconnected from {self.address}"))
        self.socket.strangers.info(f"a peer that is not a worker disconnected from "
                                   f"{self.address}")

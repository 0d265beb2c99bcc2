"""Background work in lanes of niced threads: queued jobs can be cancelled, and a job that
overstays frees its lane's thread.

A lane is a FIFO queue served by its own threads, so work in one lane never waits behind work
in another (e.g. small grammars behind big ones). The threads run at a lower CPU priority
(`nice`) than the thread that made them, so the work they do yields the cores to a step loop
and its workers. A running job cannot be interrupted (the grammar engine's calls are one
native call each), but once it has run `overdue_s` its lane starts a fresh thread and the old
one, niced further, finishes the job on its own and exits; at most `max_overdue` such threads
run at a time, which bounds what a flood of slow jobs can take from the machine.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("deltaserve")
OVERDUE_NICE = 19  # the niceness of a thread whose job overstayed


class Job:
    """One call in a lane: `result`/`error` once `done`; `started` and `finished` are
    time.monotonic() values (None until then)."""

    __slots__ = ("fn", "lane", "result", "error", "started", "finished", "cancelled",
                 "on_done")

    def __init__(self, fn: Callable[[], Any], lane: str,
                 on_done: Callable[[Job], None] | None) -> None:
        self.fn, self.lane, self.on_done = fn, lane, on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self.started: float | None = None
        self.finished: float | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def seconds(self) -> float:
        """How long it ran (so far, if it is still running; 0 if it has not started)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.monotonic()) - self.started


class _Lane:
    def __init__(self, name: str, threads: int, nice: int, lock: threading.Lock) -> None:
        self.name, self.threads, self.nice = name, threads, nice
        self.work = threading.Condition(lock)  # its threads wait here for jobs
        self.queue: deque[Job] = deque()
        self.running: dict[int, tuple[Job, int]] = {}  # worker id -> (job, native thread id)
        self.workers: set[int] = set()  # worker ids serving this lane (not retired)


class WorkLanes:
    """Named lanes: name -> (threads, niceness). Threads start on first use and stop at
    `shutdown`."""

    def __init__(self, lanes: dict[str, tuple[int, int]], name: str,
                 overdue_s: float | None = None, max_overdue: int = 2) -> None:
        self._lock = threading.Lock()
        self._lanes = {lane: _Lane(lane, n, nice, self._lock)
                       for lane, (n, nice) in lanes.items()}
        self._name = name
        self.overdue_s, self.max_overdue = overdue_s, max_overdue
        self._cond = threading.Condition(self._lock)  # waiters wait here for jobs to end
        self._next_worker = 0
        self._retired: set[int] = set()  # worker ids whose job overstayed
        self._closed = False

    def submit(self, lane: str, fn: Callable[[], Any],
               on_done: Callable[[Job], None] | None = None) -> Job:
        """Queue `fn` in `lane`; `on_done(job)` runs on the lane's thread when it ends."""
        job = Job(fn, lane, on_done)
        with self._cond:
            if self._closed:
                raise RuntimeError("the work lanes are shut down")
            state = self._lanes[lane]
            state.queue.append(job)
            if len(state.workers) < state.threads:
                self._start_worker(state)
            state.work.notify()
        return job

    def queued(self, lane: str) -> int:
        """Jobs waiting for a thread in `lane` (cancelled ones included until skipped)."""
        return len(self._lanes[lane].queue)

    def cancel(self, job: Job) -> bool:
        """Drop a job that has not started; False if it has (it then runs to its end)."""
        with self._cond:
            if job.started is not None:
                return False
            job.cancelled = True
            try:
                self._lanes[job.lane].queue.remove(job)
            except ValueError:
                pass
            return True

    def wait(self, jobs: list[Job], deadline: float | None = None) -> bool:
        """Wait until every job is done (or cancelled) or time.monotonic() passes
        `deadline` (None: no deadline); True if all are."""
        i = 0  # jobs[:i] have ended (jobs end roughly in order: one pass in all)
        with self._cond:
            while True:
                while i < len(jobs) and (jobs[i].done or jobs[i].cancelled):
                    i += 1
                if i == len(jobs):
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)

    def check_overdue(self) -> None:
        """Give each lane whose running job has overstayed `overdue_s` a fresh thread (while
        fewer than `max_overdue` overdue threads run), so queued work goes on."""
        if self.overdue_s is None:
            return
        now = time.monotonic()
        with self._cond:
            for state in self._lanes.values():
                for worker, (job, tid) in list(state.running.items()):
                    if worker in self._retired or job.started is None or \
                            now - job.started < self.overdue_s:
                        continue
                    if len(self._retired) >= self.max_overdue:
                        return
                    self._retired.add(worker)
                    state.workers.discard(worker)
                    _renice(tid, OVERDUE_NICE)
                    logger.info("%s: a %s job has run %.1f s; its lane goes on in a new "
                                "thread", self._name, state.name, now - job.started)
                    if state.queue:
                        self._start_worker(state)

    def shutdown(self) -> None:
        """Drop queued jobs and let the threads exit (running jobs end on their own)."""
        with self._cond:
            self._closed = True
            for state in self._lanes.values():
                for job in state.queue:
                    job.cancelled = True
                state.queue.clear()
                state.work.notify_all()
            self._cond.notify_all()

    def _start_worker(self, state: _Lane) -> None:
        worker = self._next_worker
        self._next_worker += 1
        state.workers.add(worker)
        threading.Thread(target=self._serve, args=(state, worker), daemon=True,
                         name=f"{self._name}-{state.name}").start()

    def _serve(self, state: _Lane, worker: int) -> None:
        tid = threading.get_native_id()
        _renice(tid, state.nice)
        while True:
            with self._cond:
                while not state.queue and not self._closed and worker in state.workers:
                    state.work.wait()
                if self._closed or worker not in state.workers:
                    state.workers.discard(worker)
                    return
                job = state.queue.popleft()
                job.started = time.monotonic()
                state.running[worker] = (job, tid)
            try:
                job.result = job.fn()
            except BaseException as e:  # handed to whoever reads the job
                job.error = e
            with self._cond:
                job.finished = time.monotonic()
                del state.running[worker]
                self._cond.notify_all()
                retired = worker in self._retired
                self._retired.discard(worker)
            if job.on_done is not None:
                job.on_done(job)
            if retired:
                return


def _renice(tid: int, nice: int) -> None:
    """Lower a thread's CPU priority to `nice` (Linux: niceness is per thread)."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):
        pass  # not permitted or not supported: the work runs at normal priority

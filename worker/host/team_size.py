"""A CPU worker's team size, step by step: tried and kept by what the steps measure.

Why not a fixed team with a wait policy: on a quiet host a team of threads spinning at its
barriers (libgomp's default) is fastest, and a decode step crosses ~270 of them; sleeping at
each (OMP_WAIT_POLICY=passive) costs a wake-up per barrier, ~40 us on a VM whose idle vCPU
halts (SmolLM2 one stream: 0.4x the quiet speed). Beside a CPU-bound neighbour the spinning
team collapses instead (0.2x): one teammate is descheduled, the other spins its slice away
at the next barrier. A team of one has no barriers, so with a neighbour on one of two cores
it runs on the other at its full one-thread speed (benchmarks/bench_contention.py). Which
size wins depends on what the neighbours do (a bursty one may leave a spinning pair
faster), so the steps decide:

  * `LoadMeter` (worker/host/load_meter.py) reads, every `interval_s`, how much CPU the
    host's other processes used on this process's CPUs (/proc/stat less this worker, its
    engine core and its front-end, whose detokenizing is the same engine's work):
    `team_size(CPUs - that - reserved)` is the size worth trying (`reserved`: the CPU an
    engine core under async scheduling takes beside every step,
    worker/host/setup.engine_core_reserve), and when it differs from the current one a trial
    starts. An idle spell (a gap of over `idle_s` between steps) drops the window under way
    and starts one of `first_s` (a host that went quiet while the worker idled is seen
    within a few steps); until it is read, a prefill-sized step (`burst_rows`) runs at the
    planned size (a batch's first step after idling beside a neighbour that has since left
    would otherwise run at one thread: 10 % of a 32-stream run). The worker reads a passed
    window's end after sending a step's answer (`after_send`), off the path between
    receiving a step and running it;
  * a trial runs `trial_steps` steps at the other size (its first step, which wakes or parks
    a thread, is not counted) and compares their mean time (what throughput counts: a
    collapsing pair is as fast as one thread on most steps and 10x slower on a few) with
    the steps just before it at the current size (up to 32, of the same shape only: the
    same number of token rows). A smaller team must be 15 % faster to stay, and is judged
    against steps under the load that prompted it (a neighbour arrived: at least
    `trial_steps` of them first, each tagged with the reading of the window it ran in; or,
    when the same shrink won under that load before, the steps it won against: a neighbour
    that comes back costs no second run of collapsing steps); a larger one must be no
    slower, and starts at once (the meter read the cores free: any steps at the current
    size are its reference, and with none it stays). A shrinking trial ends at once when
    its steps' median is 1.5x the reference's (a quiet host's false alarm costs two
    steps), a growing one at a step twice as slow (a collapsing team);
  * a trial that loses is not repeated for `backoff_s` (doubling up to `max_backoff_s`)
    unless the load moves by `RISE` CPUs from what it was then (a neighbour arrived or
    left); below the planned size, the planned size is tried again after `regrow_s`
    (doubling up to `max_backoff_s` while it loses): a neighbour may have turned bursty.
On a quiet host nothing is tried and nothing is spent.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.host.load_meter import LoadMeter

RISE = 0.4  # CPUs of other processes' load that end a losing trial's backoff


def team_size(free_cores: float, max_threads: int) -> int:
    return max(1, min(max_threads, round(free_cores)))


@dataclass
class TeamSizer:
    max_threads: int
    load: LoadMeter
    trial_steps: int = 8
    backoff_s: float = 2.0
    max_backoff_s: float = 30.0
    regrow_s: float = 5.0  # below max_threads: the first try of max_threads after this
    # CPUs this engine keeps busy beside every step (not in `load.others`): the engine core
    # under async scheduling, which schedules the next step while this one runs
    reserved: float = 0.0
    clock: Callable[[], float] = time.monotonic
    current: int = 0  # the team size in use (max_threads to start)
    trial: int | None = None  # the size on trial, if any
    # (rows, seconds, others) of the latest steps at the current size: a trial's reference,
    # long enough that a neighbour's short burst does not make the current size look slow.
    # `others` is the reading of the window the step ran in (None until it is read)
    _recent: deque = field(default_factory=lambda: deque(maxlen=32))
    _trial_times: list = field(default_factory=list)
    _reference: list = field(default_factory=list)  # (rows, seconds)
    _next_trial: float = 0.0
    _lost_at_load: float = float("inf")  # others when the last trial lost
    _backoff: float = 0.0
    _regrow_at: float = float("inf")  # when max_threads is tried again (if below it)
    _regrow_backoff: float = 0.0
    idle_s: float = 0.05  # a longer gap between steps is an idle spell
    burst_rows: int = 256  # a step this large after an idle spell runs at max_threads
    burst: bool = False  # this step runs at max_threads outside the current size
    _ended: float = float("inf")  # when the last step ended
    _stale: bool = False  # idled since the meter's last reading
    # the last shrink that won: ((from size, to size), others then, its reference steps)
    _shrink: tuple | None = None

    def __post_init__(self) -> None:
        self.current = self.current or self.max_threads
        self._backoff, self._regrow_backoff = self.backoff_s, self.regrow_s

    @property
    def size(self) -> int:
        return self.trial or (self.max_threads if self.burst else self.current)

    def before_step(self, rows: int = 0) -> int:
        """The team size for a step of `rows` token rows (it starts a trial when other
        processes' load suggests one). After an idle spell the load is unknown until the
        meter's first window: a prefill-sized step then runs at the planned size, which
        beside a neighbour costs little (its parallel regions are long) and on a host that
        went quiet while the worker idled saves half its time."""
        now = self.clock()
        if now - self._ended > self.idle_s:
            self._tag(self.load.others)  # the window they ran in is dropped unread
            self.load.restart()
            self._stale = True
        if self.trial is None and self.load.update(now):
            self._stale = False
            self._tag(self.load.others)
            self._consider(now, self.load.others)
        self.burst = self._stale and self.trial is None and rows >= self.burst_rows
        return self.size

    def after_send(self) -> None:
        """Off the step's path (its answer sent): read the load meter's window if it has
        passed, for the next before_step (it reads only when no trial runs, as that does)."""
        if self.trial is None:
            self.load.read_ahead(self.clock())

    def _consider(self, now: float, others: float) -> None:
        """Start a trial of the size `others` CPUs of load leave room for, if worth it."""
        wanted = self._wanted(others)
        if wanted == self.current:
            if self.current == self.max_threads or now < self._regrow_at:
                return
            wanted = self.max_threads  # the planned size again: a neighbour may be bursty
        elif now < self._next_trial and abs(others - self._lost_at_load) < RISE:
            return  # lost lately under this load
        if wanted > self.current:
            reference = [(r, t) for r, t, _ in self._recent]
        else:  # against steps under the load that prompted it
            reference = [(r, t) for r, t, load in self._recent if abs(load - others) < RISE]
            if len(reference) < self.trial_steps:
                reference = self._recall(wanted, others) + reference
            if len(reference) < self.trial_steps:
                return
        self.trial, self._trial_times, self._reference = wanted, [], reference

    def _wanted(self, others: float) -> int:
        """The size the CPUs left by `others` and this engine's own reserve make room for."""
        return team_size(len(self.load.cpus) - others - self.reserved, self.max_threads)

    def after_step(self, rows: int, seconds: float) -> None:
        """Record a step's time (a trial ends won or lost here)."""
        self._ended = self.clock()
        if self.burst:
            return  # not at the current size: no one's reference
        if self.trial is None:
            self._recent.append((rows, seconds, None))
            return
        self._trial_times.append((rows, seconds))
        counted = self._trial_times[1:]  # the first step woke or parked a thread
        if not counted:
            return
        shape = counted[0][0]
        trial = [t for r, t in counted if r == shape]
        reference = [t for r, t in self._reference if r == shape]
        grows = self.trial > self.current
        if reference and (counted[-1][1] > 2 * statistics.median(reference) if grows else
                          statistics.median(trial) > 1.5 * statistics.median(reference)):
            return self._lose()  # clearly worse: no need to see more
        if len(counted) < self.trial_steps:
            return
        half = self.trial_steps // 2
        if len(trial) < half or len(reference) < half:
            if grows:  # the meter read the cores free, and nothing says otherwise
                return self._win(counted)
            self.trial, self._next_trial = None, self.clock() + self.backoff_s
            self._lost_at_load = self.load.others
            return  # steps of other shapes: no verdict, try later
        # Shrinking must win clearly (a bursty neighbour makes single trials noisy; a
        # CPU-bound one halves the step time); growing back needs only to be no slower.
        margin = 1.0 if grows else 0.85
        if statistics.fmean(trial) < margin * statistics.fmean(reference):
            return self._win(counted)
        return self._lose()

    def _tag(self, others: float) -> None:
        """Tag the steps since the meter's last sample (they ran in the window it just
        read, or in one dropped) with `others`."""
        for i in range(len(self._recent) - 1, -1, -1):
            rows, seconds, load = self._recent[i]
            if load is not None:
                break
            self._recent[i] = (rows, seconds, others)

    def _recall(self, wanted: int, others: float) -> list:
        """The reference a shrink from the current size to `wanted` won against under this
        load, if one did: a neighbour that comes back is not paid for again with
        `trial_steps` steps of a collapsing team."""
        if self._shrink is None:
            return []
        sizes, load, reference = self._shrink
        return list(reference) if sizes == (self.current, wanted) and \
            abs(load - others) < RISE else []

    def _win(self, counted: list) -> None:
        grew = self.trial > self.current
        if not grew:
            self._shrink = ((self.current, self.trial), self.load.others,
                            self._reference[-self._recent.maxlen:])  # the latest
        elif self._shrink is not None and abs(self._shrink[1] - self.load.others) < RISE:
            self._shrink = None  # the larger team is faster again under that load
        self.current, self.trial = self.trial, None
        self._recent.clear()
        self._recent.extend((r, t, self.load.others) for r, t in counted)
        self._lost_at_load, self._backoff = float("inf"), self.backoff_s
        if not grew:
            self._regrow_backoff = self.regrow_s
        self._regrow_at = (self.clock() + self._regrow_backoff
                           if self.current < self.max_threads else float("inf"))

    def _lose(self) -> None:
        now = self.clock()
        if self.trial < self.current:
            self._shrink = None  # what won before does not hold now
        if self.trial == self.max_threads and self.current < self.max_threads \
                and self._wanted(self.load.others) == self.current:  # a timed regrow
            self._regrow_backoff = min(2 * self._regrow_backoff, self.max_backoff_s)
            self._regrow_at = now + self._regrow_backoff
        else:
            self._next_trial, self._lost_at_load = now + self._backoff, self.load.others
            self._backoff = min(2 * self._backoff, self.max_backoff_s)
        self.trial = None

"""How much CPU the host's other processes use on a worker's CPUs, window by window
(/proc/stat less this worker, its engine core and its front-end, whose detokenizing is the
same engine's work): what a CPU worker's team size (worker/host/team_size.py) follows."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
Sample = tuple[float, float, float]  # (wall s, busy CPU s on our CPUs, this process's CPU s)


def _cpu_seconds(pid: int | str) -> float:
    """CPU seconds (user + system) process `pid` has used; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def engine_pids() -> tuple[int, ...]:
    """This worker's engine: its parent (the engine core) and grandparent (the front-end),
    whose CPU is the same engine's pipeline, not a neighbour's (init excluded)."""
    pids, pid = [], os.getpid()
    for _ in range(2):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        pids.append(pid)
    return tuple(pids)


def read_sample(cpus: frozenset[int], ours: tuple[int, ...] = ()) -> Sample:
    """Now: monotonic seconds, CPU seconds spent busy on `cpus` since boot (all processes),
    CPU seconds this process and the processes `ours` have used."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu":
                continue
            if int(name[3:]) in cpus:
                ticks = [int(v) for v in rest.split()]
                busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # all but idle and iowait
    own = _cpu_seconds("self") + sum(_cpu_seconds(pid) for pid in ours)
    return time.monotonic(), busy / CLOCK_TICK, own


@dataclass
class LoadMeter:
    """CPUs other processes used on `cpus` over the last window of `interval_s`."""

    cpus: frozenset[int]
    interval_s: float = 0.25
    first_s: float = 0.1  # the first window after an idle spell (or the first sample)
    ours: tuple[int, ...] = ()  # processes of this engine whose CPU is not "others"
    sample: Callable[[frozenset[int], tuple[int, ...]], Sample] = read_sample
    others: float = 0.0
    _last: Sample | None = None
    _window: float = 0.0  # the length of the window under way
    _ahead: Sample | None = None  # the end of a passed window, read ahead (read_ahead)

    def read_ahead(self, now: float) -> None:
        """If the window under way has passed by `now`, read its end now (the worker calls
        this after a step's answer is sent): the next update takes that sample instead of
        reading /proc on the step's path."""
        if (self._ahead is None and self._last is not None
                and now - self._last[0] >= self._window):
            self._ahead = self.sample(self.cpus, self.ours)

    def update(self, now: float) -> bool:
        """Read a new window if one has passed (or take the sample read ahead); True when
        `others` is fresh."""
        if self._ahead is None and self._last is not None and now - self._last[0] < self._window:
            return False
        sample = self._ahead or self.sample(self.cpus, self.ours)
        self._ahead = None
        last, self._last = self._last, sample
        if last is None or sample[0] <= last[0]:
            self._window = self.first_s
            return False
        self._window = self.interval_s
        used = (sample[1] - last[1]) - (sample[2] - last[2])
        self.others = max(0.0, used) / (sample[0] - last[0])
        return True

    def restart(self) -> None:
        """Drop the window under way (the worker idled through it: it would average what
        others did while nothing of ours ran) and start one of `first_s`."""
        self._last = self._ahead = None


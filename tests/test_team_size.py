"""A CPU worker's team size (worker/host/team_size.py) on a simulated host: tried and kept
by what the steps measure beside neighbours that come, go and idle, with the CPU an async
engine core reserves; and the load meter (worker/host/load_meter.py) on this host."""
from __future__ import annotations

import os

import pytest
import torch

from protocol import EngineConfig
from worker.host.load_meter import LoadMeter, engine_pids, read_sample
from worker.host.setup import engine_core_reserve, set_up_host
from worker.host.team_size import TeamSizer, team_size
from worker.host.threads import BIND_ENV, plan_threads


class FakeLoad(LoadMeter):
    """Other processes use `others` CPUs of two; a new window every call."""

    def update(self, now: float) -> bool:
        return True


class Host:
    def __init__(self, others: float, step_s: dict[int, float], metered: bool = False,
                 reserved: float = 0.0, ahead: bool = False) -> None:
        self.now, self.others, self.others_s = 0.0, others, 0.0
        # metered: a real LoadMeter over this host's clock (windows, idle spells) instead of
        # a fresh reading of `others` at every step
        self.load = (LoadMeter(frozenset({0, 1}), sample=self._sample)
                     if metered else FakeLoad(frozenset({0, 1}), others=others))
        self.ahead = ahead  # the worker's after_send after each step (the meter read there)
        self.reads: list[str] = []  # where the meter read: "before_step" or "after_send"
        self._where = ""
        self.step_s = step_s  # team size -> seconds per step (or a cycle of them)
        self.sizer = TeamSizer(2, self.load, trial_steps=4, backoff_s=1.0,
                               max_backoff_s=8.0, clock=lambda: self.now, reserved=reserved)
        self.sizes: list[int] = []

    def _sample(self, cpus, ours) -> tuple[float, float, float]:
        self.reads.append(self._where)
        return self.now, self.others_s, 0.0

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.others_s += self.others * seconds

    def steps(self, n: int, rows: int = 1) -> None:
        for _ in range(n):
            self._where = "before_step"
            size = self.sizer.before_step(rows)
            assert size == self.sizer.size
            self.sizes.append(size)
            times = self.step_s[size]
            seconds = times[len(self.sizes) % len(times)] if isinstance(times, list) else times
            self.wait(seconds)
            self.sizer.after_step(rows, seconds)
            if self.ahead:
                self._where = "after_send"
                self.sizer.after_send()


def test_a_quiet_host_tries_nothing():
    host = Host(0.1, {2: 0.005, 1: 0.008})
    host.steps(200)
    assert set(host.sizes) == {2} and host.sizer.current == 2


def test_beside_a_neighbour_one_thread_is_tried_and_kept():
    host = Host(1.0, {2: 0.05, 1: 0.01})  # the pair collapses
    host.steps(40)
    assert host.sizes[:4] == [2] * 4 and host.sizes[4:9] == [1] * 5  # a trial of 5 steps
    assert host.sizer.current == 1 and set(host.sizes[9:]) == {1}
    host.load.others = 1.0
    host.step_s[2] = 0.004  # the neighbour turned bursty: the pair is faster again
    host.steps(2000)  # ~8 s: the planned size is tried again, and wins
    assert host.sizer.current == 2


def test_beside_an_async_engine_core_one_thread_is_tried():
    """Under async scheduling the engine core takes a CPU beside every step (its CPU is
    ours, not others'): a quiet host's pair that it makes collapse gives way to one thread;
    where the pair stays faster the trial loses at once and backs off."""
    host = Host(0.0, {2: 0.004, 1: 0.003}, reserved=1.0)
    host.steps(40)
    assert host.sizes[4:9] == [1] * 5 and host.sizer.current == 1
    host = Host(0.0, {2: 0.005, 1: 0.009}, reserved=1.0)
    host.steps(400)  # 2 s
    assert host.sizer.current == 2 and host.sizes.count(1) <= 6


def test_the_engine_core_reserve_follows_async_scheduling():
    sync, run_async = EngineConfig(model="m"), EngineConfig(model="m", async_scheduling=True)
    assert engine_core_reserve(sync, 1) == 0.0 and engine_core_reserve(run_async, 1) == 1.0
    assert engine_core_reserve(run_async, 2) == 0.5  # TP=2: one core for both ranks
    replicas = EngineConfig(model="m", async_scheduling=True, data_parallel_size=2)
    assert engine_core_reserve(replicas, 2) == 1.0  # a core per replica


def test_an_async_engine_sizes_its_team_with_the_reserve(monkeypatch):
    """What a CPU worker sets up (its thread plan counted from the host, as without
    OMP_NUM_THREADS): under async scheduling the sizer leaves the engine core its CPU."""
    if plan_threads(None, 1, 0, env={}).num_threads < 2:
        pytest.skip("one usable CPU: a team of one, no sizer")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setenv("DELTASERVE_KEEP_MALLOC", "0")
    threads = torch.get_num_threads()
    try:
        for async_scheduling, reserved in ((False, 0.0), (True, 1.0)):
            host = set_up_host(EngineConfig(model="m", async_scheduling=async_scheduling), 0)
            assert host.sizer is not None and host.sizer.reserved == reserved
    finally:
        torch.set_num_threads(threads)


def test_a_losing_trial_backs_off():
    host = Host(1.0, {2: 0.005, 1: 0.008})  # busy, yet the pair stays faster
    host.steps(12)  # the trial ends at its first counted step, 1.6x the pair's
    assert host.sizes[4:6] == [1] * 2 and host.sizes[6:] == [2] * 6
    assert host.sizer.current == 2
    host.steps(3000)  # 15 s: trials at 0, 1, 3, 7 and 15 s (backing off 1, 2, 4, 8 s)
    trials = [i for i in range(1, len(host.sizes)) if host.sizes[i] == 1 != host.sizes[i - 1]]
    assert 4 <= len(trials) <= 5 and host.sizer.current == 2


def test_a_collapsing_pair_is_judged_by_its_time():
    """Beside a CPU-bound neighbour most of the pair's steps are as fast as one thread's;
    a few wait a whole time slice for the descheduled teammate. Their mean counts."""
    host = Host(1.0, {2: [0.016] * 4 + [0.160], 1: 0.015})
    host.steps(40)
    assert host.sizer.current == 1 and set(host.sizes[9:]) == {1}


def test_the_team_grows_as_soon_as_the_neighbour_leaves():
    host = Host(1.0, {2: 0.05, 1: 0.015})
    host.steps(20)
    assert host.sizer.current == 1
    host.load.others, host.step_s[2] = 0.0, 0.008  # the neighbour left
    host.steps(6)  # at once: no steps under the new load needed first
    assert host.sizes[-6:] == [2] * 6 and host.sizer.current == 2


def test_a_neighbour_arriving_ends_the_backoff():
    host = Host(0.6, {2: 0.005, 1: 0.008})  # some load, the pair faster: trials lose
    host.steps(700)  # 3.5 s: backing off 1, 2, 4 s
    assert host.sizer.current == 2
    host.load.others, host.step_s[2] = 1.1, 0.05  # a CPU-bound neighbour: the pair collapses
    host.steps(10)
    assert host.sizer.current == 1  # at once, not after the 4 s backoff


def test_steps_of_another_shape_give_no_verdict():
    host = Host(1.0, {2: 0.05, 1: 0.01})
    host.steps(6, rows=1)
    host.steps(5, rows=32)  # the trial's steps are prefill-sized: nothing to compare with
    assert host.sizer.current == 2 and host.sizer.trial is None
    assert team_size(2 - 0.3, 2) == 2 and team_size(2 - 0.7, 2) == 1
    assert team_size(0.0, 4) == 1 and team_size(9.0, 4) == 4


def test_the_load_meter_counts_other_processes():
    samples = iter([(0.0, 0.0, 0.0), (0.5, 0.9, 0.4)])  # 0.9 CPU s busy, 0.4 of them ours
    meter = LoadMeter(frozenset({0, 1}), interval_s=0.25,
                      sample=lambda cpus, ours: next(samples))
    assert meter.update(0.0) is False  # the first sample
    assert meter.update(0.05) is False  # within the window: nothing read
    assert meter.update(0.5) is True and meter.others == pytest.approx(1.0)


def test_after_an_idle_spell_the_first_window_is_short():
    samples = iter([(0.0, 0.0, 0.0), (5.0, 6.0, 1.0), (5.1, 6.2, 1.1), (5.35, 6.7, 1.35),
                    (7.35, 9.7, 3.35)])
    meter = LoadMeter(frozenset({0, 1}), interval_s=0.25, first_s=0.1,
                      sample=lambda cpus, ours: next(samples))
    assert meter.update(0.0) is False
    meter.restart()  # 5 s idle: what others did then does not count
    assert meter.update(5.0) is False
    assert meter.update(5.11) is True and meter.others == pytest.approx(1.0)
    assert meter.update(5.2) is False  # windows of interval_s from now on
    assert meter.update(5.37) is True and meter.others == pytest.approx(1.0)
    # a window a long step made long (no idle spell) counts
    assert meter.update(7.35) is True and meter.others == pytest.approx(0.5)


def test_after_an_idle_spell_a_prefill_runs_at_the_planned_size():
    """The team shrank beside a neighbour; the neighbour left while the worker idled. The
    meter knows nothing yet, so a prefill-sized step runs at the planned size; decode steps
    keep the current size until the first window is read, then the team grows back."""
    host = Host(1.0, {2: 0.05, 1: 0.015}, metered=True)
    host.steps(60)
    assert host.sizer.current == 1
    host.others, host.step_s[2] = 0.0, 0.008
    host.wait(3.0)
    host.steps(1, rows=2048)
    host.steps(1, rows=32)
    assert host.sizes[-2:] == [2, 1] and host.sizer.current == 1  # the burst is no trial
    host.steps(20, rows=32)  # the first window (0.1 s) is read: a growing trial, and it wins
    assert host.sizer.current == 2 and set(host.sizes[-8:]) == {2}


def test_after_an_idle_spell_beside_the_neighbour_the_team_stays_small():
    host = Host(1.0, {2: 0.05, 1: 0.015}, metered=True)
    host.steps(60)
    host.wait(3.0)  # idle, the neighbour still there
    host.steps(1, rows=2048)  # unknown load: at the planned size
    host.steps(1, rows=1)  # a decode-sized step keeps the current size
    host.steps(40)
    assert host.sizes[-42:-40] == [2, 1] and set(host.sizes[-40:]) == {1}
    assert host.sizer.current == 1 and host.sizer.trial is None
    assert 2048 not in [rows for rows, _, _ in host.sizer._recent]  # no one's reference


def test_no_idle_spell_between_steps_no_burst():
    host = Host(1.0, {2: 0.05, 1: 0.015}, metered=True)
    host.steps(60)
    host.steps(3, rows=2048)  # back to back: the meter's windows are fresh enough
    assert host.sizes[-3:] == [1, 1, 1]


def test_the_load_meter_takes_a_window_read_ahead():
    samples = iter([(0.0, 0.0, 0.0), (0.3, 0.6, 0.3), (0.6, 1.2, 0.6), (5.0, 9.0, 2.0),
                    (5.01, 9.0, 2.0)])
    meter = LoadMeter(frozenset({0, 1}), interval_s=0.25, first_s=0.25,
                      sample=lambda cpus, ours: next(samples))
    meter.read_ahead(0.0)  # no window under way: nothing read
    assert meter.update(0.0) is False  # the first sample
    meter.read_ahead(0.1)  # not passed yet: nothing read
    meter.read_ahead(0.3)  # passed: its end read now
    meter.read_ahead(0.31)  # one sample ahead at most
    assert meter.update(0.31) is True and meter.others == pytest.approx(1.0)  # not read
    meter.read_ahead(0.6)
    meter.restart()  # an idle spell drops the window, the sample read ahead with it
    assert meter.update(5.0) is False and meter._last[0] == 5.0


def _neighbour_story(host: Host) -> list[int]:
    """A neighbour beside the steps, then gone while the worker idles, then back: the
    team sizes the steps ran at."""
    host.steps(60)
    _leave_while_idling(host)
    _return_after_idling(host, 0.05)
    host.step_s[2] = 0.004
    host.steps(400)
    return host.sizes


def test_reading_the_meter_after_the_answer_decides_the_same():
    """The worker reads a passed window after sending a step's answer (after_send): the
    sizes are the ones reading it before the next step gives (no time passes between the
    two here), and before_step reads /proc only where a window starts (the first step and
    after an idle spell)."""
    hosts = [Host(1.0, {2: 0.05, 1: 0.015}, metered=True, ahead=ahead)
             for ahead in (False, True)]
    sizes = [_neighbour_story(host) for host in hosts]
    assert sizes[0] == sizes[1] and len(set(sizes[0])) == 2
    late, ahead = hosts
    assert late.reads.count("before_step") > 20
    assert ahead.reads.count("before_step") == 3  # the first step, two idle spells
    assert ahead.reads.count("after_send") == late.reads.count("before_step") - 3


def test_samples_of_this_host_are_consistent():
    cpus = frozenset(os.sched_getaffinity(0))
    t0, busy0, own0 = read_sample(cpus)
    sum(i * i for i in range(300_000))
    t1, busy1, own1 = read_sample(cpus, engine_pids())
    assert t1 > t0 and busy1 >= busy0 and own1 >= own0
    assert os.getppid() in engine_pids() and 1 not in engine_pids()



def _return_after_idling(host: Host, step_2: float) -> list[int]:
    """The neighbour (back, or still there) beside a batch after a 3 s idle spell: a
    prefill long enough for the meter's first window, then 12 decode steps; their sizes."""
    host.others, host.step_s[2] = 1.0, 0.3
    host.wait(3.0)
    host.steps(1, rows=2048)  # at the planned size: the load is unknown
    host.step_s[2] = step_2
    host.steps(12)
    return host.sizes[-12:]


def _leave_while_idling(host: Host) -> None:
    host.others, host.step_s[2] = 0.0, 0.008
    host.wait(3.0)
    host.steps(1, rows=2048)
    host.steps(40)  # the team grows back at once; these steps fill its references
    assert host.sizer.current == 2


def test_a_neighbour_that_comes_back_is_not_paid_for_twice():
    """One thread beat the collapsing pair under this load: when the neighbour comes back
    after the team grew without it, the first reading of its load starts the trial at
    once, against the pair's steps that lost last time; a shrink that later loses (or a
    pair that wins again under that load) is forgotten."""
    host = Host(1.0, {2: 0.05, 1: 0.015}, metered=True)
    first = _return_after_idling(host, 0.05)
    assert first[:4] == [2] * 4 and host.sizer.current == 1  # references first
    _leave_while_idling(host)
    assert _return_after_idling(host, 0.05) == [1] * 12 and host.sizer.current == 1
    host.step_s[2] = 0.004  # the neighbour turned bursty: the pair wins again, same load
    host.steps(2000)
    assert host.sizer.current == 2
    _leave_while_idling(host)
    again = _return_after_idling(host, 0.05)
    assert again[:4] == [2] * 4 and host.sizer.current == 1  # references first again


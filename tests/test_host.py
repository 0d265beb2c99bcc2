"""The host a CPU worker runs on (worker/host/): threads from the affinity mask and the cgroup
quota divided among the ranks, vLLM's VLLM_CPU_OMP_THREADS_BIND, the team sized to the
cores other processes leave free, AMX only where Linux grants it, and the memory it can give
(a cgroup limit's room)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocol import EngineConfig
from worker.host import amx, memory
from worker.host.cgroup import cgroup_memory_room
from worker.host.setup import engine_core_reserve, ranks_on_this_host, set_up_host
from worker.host.team_size import (
    LoadMeter,
    TeamSizer,
    engine_pids,
    read_sample,
    team_size,
)
from worker.host.threads import (
    BIND_ENV,
    cgroup_cpu_quota,
    format_cpu_list,
    parse_cpu_list,
    plan_threads,
)

FOUR = {0, 1, 2, 3}


def test_threads_follow_the_mask_and_are_divided_among_ranks():
    plan = plan_threads(None, 1, 0, env={}, cpus=FOUR, read_quota=False)
    assert (plan.num_threads, plan.adaptive, plan.bind) == (4, True, None)
    assert plan.describe() == "4 threads (4 CPUs in the affinity mask)"
    plan = plan_threads(None, 3, 2, env={}, cpus=FOUR, read_quota=False)
    assert plan.num_threads == 1 and "/ 3 ranks on this host" in plan.reason
    assert plan_threads(None, 8, 0, env={}, cpus={0}, read_quota=False).num_threads == 1


def test_ranks_that_fill_the_mask_get_a_cpu_each():
    """TP=2 on 2 CPUs: each rank's thread pinned to its own CPU (not when a quota caps the
    CPUs, nor when the ranks leave CPUs over, nor for one rank)."""
    plans = [plan_threads(None, 2, i, env={}, cpus={4, 6}, read_quota=False) for i in (0, 1)]
    assert [(p.num_threads, p.bind, p.adaptive) for p in plans] == [(1, (4,), False),
                                                                    (1, (6,), False)]
    assert plans[1].describe() == ("1 thread (2 CPUs in the affinity mask / 2 ranks on this "
                                   "host, a CPU each, pinned to CPU 6)")
    assert plan_threads(None, 2, 1, env={}, cpus={0, 1}, quota=1.0).bind is None
    assert plan_threads(None, 2, 1, env={BIND_ENV: "auto"}, cpus={0, 1},
                        read_quota=False).bind == (1,)
    for unbound in ("all", "nobind"):
        assert plan_threads(None, 2, 1, env={BIND_ENV: unbound}, cpus={0, 1},
                            read_quota=False).bind is None
    assert plan_threads(None, 3, 2, env={}, cpus=FOUR, read_quota=False).bind is None
    assert plan_threads(None, 1, 0, env={}, cpus={0}, read_quota=False).bind is None


def test_a_cgroup_quota_caps_the_threads_rounded_up():
    assert plan_threads(None, 1, 0, env={}, cpus=FOUR, quota=1.5).num_threads == 2
    assert plan_threads(None, 1, 0, env={}, cpus=FOUR, quota=2.0).num_threads == 2
    assert plan_threads(None, 1, 0, env={}, cpus=FOUR, quota=0.2).num_threads == 1
    plan = plan_threads(None, 2, 0, env={}, cpus=FOUR, quota=3.0)
    assert plan.num_threads == 1  # min(4, 3) CPUs over 2 ranks
    assert plan.reason == ("4 CPUs in the affinity mask, cgroup quota 3 CPUs / 2 ranks on "
                           "this host")


def test_what_the_user_sets_wins_and_is_not_adapted():
    assert plan_threads(3, 2, 0, env={"OMP_NUM_THREADS": "1"}, cpus=FOUR) == \
        plan_threads(3, 1, 0, env={}, cpus={0})
    plan = plan_threads(3, 2, 0, env={"OMP_NUM_THREADS": "1"}, cpus=FOUR)
    assert (plan.num_threads, plan.reason, plan.adaptive) == (3, "--num-threads", False)
    plan = plan_threads(None, 2, 0, env={"OMP_NUM_THREADS": "1"}, cpus=FOUR)
    assert (plan.num_threads, plan.reason, plan.adaptive) == (1, "$OMP_NUM_THREADS", False)


def test_vllm_bind_lists_pin_each_rank():
    env = {BIND_ENV: "0-1|2,3", "OMP_NUM_THREADS": "7"}
    first, second = (plan_threads(None, 2, i, env=env, cpus=FOUR) for i in (0, 1))
    assert (first.num_threads, first.bind, second.bind) == (2, (0, 1), (2, 3))
    assert first.describe() == f"2 threads ({BIND_ENV}, pinned to CPUs 0-1)"
    for unbound in ("auto", "all", "nobind", ""):
        assert plan_threads(None, 1, 0, env={BIND_ENV: unbound}, cpus=FOUR,
                            read_quota=False).bind is None
    with pytest.raises(ValueError, match="local rank 2"):
        plan_threads(None, 3, 2, env=env, cpus=FOUR)
    for bad in ("0-x", "1,1", ""):
        with pytest.raises(ValueError, match=BIND_ENV):
            parse_cpu_list(bad)
    assert parse_cpu_list(" 0-2, 8,10-11") == [0, 1, 2, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 8, 10]) == "0-2,8,10-11"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path):
    _write(tmp_path / "proc", "0::/machine/job\n")
    _write(tmp_path / "fs/cpu.max", "max 100000\n")
    _write(tmp_path / "fs/machine/cpu.max", "300000 100000\n")
    _write(tmp_path / "fs/machine/job/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 1.5
    _write(tmp_path / "fs/machine/job/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 3.0


def test_cgroup_v1_quota_and_none(tmp_path):
    _write(tmp_path / "proc", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 0.5
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") is None
    # a container sees its own cgroup as the root: the host's path is missing under the mount
    _write(tmp_path / "proc", "3:cpu,cpuacct:/docker/elsewhere\n")
    _write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_quota_us", "200000\n")
    _write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "proc") == 2.0
    assert cgroup_cpu_quota(tmp_path / "fs", tmp_path / "missing") is None


def test_cgroup_v2_memory_room_is_the_tightest_on_the_path(tmp_path):
    """Room = limit - (usage - inactive file cache), the smallest on the path."""
    _write(tmp_path / "proc", "0::/machine/job\n")
    _write(tmp_path / "fs/memory.max", "max\n")
    _write(tmp_path / "fs/machine/memory.max", f"{8 << 30}\n")
    _write(tmp_path / "fs/machine/memory.current", f"{6 << 30}\n")
    _write(tmp_path / "fs/machine/memory.stat", f"anon 1\ninactive_file {1 << 30}\n")
    _write(tmp_path / "fs/machine/job/memory.max", f"{4 << 30}\n")
    _write(tmp_path / "fs/machine/job/memory.current", f"{1 << 30}\n")
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "proc") == 3 << 30
    _write(tmp_path / "fs/machine/job/memory.max", "max\n")
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "proc") == 3 << 30  # 8 - (6 - 1)
    _write(tmp_path / "fs/machine/memory.max", "max\n")
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "proc") is None


def test_cgroup_v1_memory_room_and_none(tmp_path):
    _write(tmp_path / "proc", "4:memory:/docker/abc\n3:cpu,cpuacct:/\n")
    job = tmp_path / "fs/memory/docker/abc"
    _write(job / "memory.limit_in_bytes", f"{2 << 30}\n")
    _write(job / "memory.usage_in_bytes", f"{1 << 30}\n")
    _write(job / "memory.stat", f"cache 5\ntotal_inactive_file {1 << 29}\n")
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "proc") == (1 << 30) + (1 << 29)
    _write(job / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "proc") is None
    assert cgroup_memory_room(tmp_path / "fs", tmp_path / "missing") is None


def test_available_memory_takes_the_smallest_figure(monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    free, source = memory.available_memory()
    assert free > 0 and source
    monkeypatch.setenv(memory.LIMIT_ENV, str(1 << 20))
    assert memory.available_memory() == (1 << 20, memory.LIMIT_ENV)
    monkeypatch.setenv(memory.LIMIT_ENV, "1G")
    with pytest.raises(ValueError, match=memory.LIMIT_ENV):
        memory.available_memory()


def test_this_host_has_a_plan():
    plan = plan_threads(None, 1, 0, env={})
    assert 1 <= plan.num_threads <= len(os.sched_getaffinity(0))


def test_ranks_on_this_host():
    config = EngineConfig(model="m", tensor_parallel_size=4)
    assert [ranks_on_this_host(config, r) for r in range(4)] == [(4, r) for r in range(4)]
    split = EngineConfig(model="m", tensor_parallel_size=4, local_ranks=[0, 1],
                         worker_address="tcp://127.0.0.1:5000", worker_secret_file="s")
    assert ranks_on_this_host(split, 1) == (2, 1)
    assert ranks_on_this_host(split, 3) == (2, 1)  # joined from another host with rank 2
    dp = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=2,
                      data_parallel_rank=1)
    assert ranks_on_this_host(dp, 1) == (4, 3)


class FakeLoad(LoadMeter):
    """Other processes use `others` CPUs of two; a new window every call."""

    def update(self, now: float) -> bool:
        return True


class Host:
    def __init__(self, others: float, step_s: dict[int, float], metered: bool = False,
                 reserved: float = 0.0) -> None:
        self.now, self.others, self.others_s = 0.0, others, 0.0
        # metered: a real LoadMeter over this host's clock (windows, idle spells) instead of
        # a fresh reading of `others` at every step
        self.load = (LoadMeter(frozenset({0, 1}), sample=lambda c, o: (self.now,
                                                                     self.others_s, 0.0))
                     if metered else FakeLoad(frozenset({0, 1}), others=others))
        self.step_s = step_s  # team size -> seconds per step (or a cycle of them)
        self.sizer = TeamSizer(2, self.load, trial_steps=4, backoff_s=1.0,
                               max_backoff_s=8.0, clock=lambda: self.now, reserved=reserved)
        self.sizes: list[int] = []

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.others_s += self.others * seconds

    def steps(self, n: int, rows: int = 1) -> None:
        for _ in range(n):
            size = self.sizer.before_step(rows)
            assert size == self.sizer.size
            self.sizes.append(size)
            times = self.step_s[size]
            seconds = times[len(self.sizes) % len(times)] if isinstance(times, list) else times
            self.wait(seconds)
            self.sizer.after_step(rows, seconds)


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


def test_samples_of_this_host_are_consistent():
    cpus = frozenset(os.sched_getaffinity(0))
    t0, busy0, own0 = read_sample(cpus)
    sum(i * i for i in range(300_000))
    t1, busy1, own1 = read_sample(cpus, engine_pids())
    assert t1 > t0 and busy1 >= busy0 and own1 >= own0
    assert os.getppid() in engine_pids() and 1 not in engine_pids()


def test_amx_is_used_only_where_granted():
    asked = []

    def request(answer: bool):
        return lambda: asked.append(answer) or answer
    assert amx.amx_state({"avx512f"}, request(True)) == "absent" and asked == []
    flags = {"avx512f", "amx_tile", "amx_int8", "amx_bf16"}
    assert amx.amx_state(flags, request(False)) == "not granted"
    assert amx.amx_state(flags, request(True)) == "granted"
    assert "not used" in amx.describe("not granted") and "oneDNN" in amx.describe("granted")


def test_asking_linux_for_amx_is_safe_here():
    """The real arch_prctl request, in a child (a grant is per process): a bool, True only
    on a CPU that has AMX."""
    code = ("from worker.host import amx; from worker.host.cpuinfo import cpuinfo_flags; "
            "granted = amx.request_tile_permission(); "
            "assert granted in (True, False); "
            "assert not granted or 'amx_tile' in cpuinfo_flags(); print(granted)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    assert out.strip() in ("True", "False")


def test_bfloat16_counts_amx_only_when_granted(monkeypatch):
    import torch

    from worker import device
    device._detect.cache_clear()
    monkeypatch.setattr(device, "cpuinfo_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    try:
        monkeypatch.setattr(device.amx, "this_process", lambda: "not granted")
        assert device._detect(torch.bfloat16) is False
        device._detect.cache_clear()
        monkeypatch.setattr(device.amx, "this_process", lambda: "granted")
        assert device._detect(torch.bfloat16) is True
    finally:
        device._detect.cache_clear()


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


_MMAPPED_AFTER_BIG_ALLOCATION = """
import ctypes, sys
from worker.host import malloc
took = malloc.keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblks  # blocks mapped before the setting (imports) stay mapped
block = bytearray(64 << 20)  # over glibc's largest mmap threshold
print(int(took), libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION")
                    is None, reason="glibc's mallopt/mallinfo2 only")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_workers_keep_big_blocks_in_the_heap(switch):
    """With the setting a 64 MiB block comes from the heap (no new mmapped block), without
    it glibc maps it."""
    env = {**os.environ, "DELTASERVE_KEEP_MALLOC": switch}
    out = subprocess.run([sys.executable, "-c", _MMAPPED_AFTER_BIG_ALLOCATION], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    took, mapped = int(out[0]), int(out[1])
    assert (took, mapped == 0) == ((1, True) if switch == "1" else (0, False))

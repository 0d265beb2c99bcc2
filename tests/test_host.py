"""The host a CPU worker runs on (worker/host/): threads from the affinity mask and the cgroup
quota divided among the ranks, vLLM's VLLM_CPU_OMP_THREADS_BIND, AMX only where Linux grants
it, and the memory it can give (a cgroup limit's room). The team sized to the cores other
processes leave free: tests/test_team_size.py."""
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
from worker.host.setup import ranks_on_this_host
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

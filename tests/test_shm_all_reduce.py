"""The shared-memory all-reduce and all-gather of local tensor-parallel CPU ranks
(worker/distributed/shm_all_reduce.py), in two real processes joined through gloo: exact sums
and gathers, identical bits on both ranks, every dtype, the gloo fallback for tensors over a
slot, a slow rank waited for, and a segment that leaves nothing behind."""
from __future__ import annotations

import math
import multiprocessing
import os
import time

import pytest
import torch

from worker.distributed import shm_all_reduce
from worker.distributed.shm_all_reduce import ShmAllReduce

pytestmark = pytest.mark.slow
WORLD = 2
# (dtype, numel) per call, in call order; the last one exceeds a slot and goes through gloo.
CALLS = ([(torch.float32, n) for n in (1, 576, 256 * 576, 3)]
         + [(torch.bfloat16, 577), (torch.float16, 64)] * 20
         + [(torch.float32, shm_all_reduce.SLOT_BYTES // 4 + 1)])


def _input(rank: int, call: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(numel, generator=generator).to(dtype)


def _expected(call: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Rank order, float32 accumulation, one rounding (what the kernel and gloo compute for
    two ranks)."""
    total = sum(_input(r, call, dtype, numel).float() for r in range(WORLD))
    return total.to(dtype)


def _rank(rank: int, init_method: str, out_dir: str) -> None:
    from worker.distributed.tensor_parallel import TensorParallel
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, WORLD, init_method, torch.device("cpu"))
    assert tp.shm is not None
    results = []
    for call, (dtype, numel) in enumerate(CALLS):
        results.append(tp.all_reduce(_input(rank, call, dtype, numel)))
    assert tp.shm._seq == len(CALLS) - 1  # the oversized call went through gloo
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def _late_peer(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 1 arrives LATE_S late at each call; rank 0 records each call's wall and CPU time."""
    from worker.distributed.tensor_parallel import TensorParallel
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, WORLD, init_method, torch.device("cpu"))
    times = []
    for _ in range(3):
        if rank == 1:
            time.sleep(LATE_S)
        wall, cpu = time.perf_counter(), time.thread_time()
        tp.all_reduce(torch.ones(576))
        times.append((time.perf_counter() - wall, time.thread_time() - cpu))
    torch.save(times, os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


LATE_S = 0.3
# (dtype, shape) per gather, between sums; the last exceeds a slot and goes through gloo
GATHERS = ([(torch.float32, (1, 96)), (torch.bfloat16, (3, 5)), (torch.float16, (2, 1, 7)),
            (torch.float32, (32, 24576))] * 3
           + [(torch.float32, (1, shm_all_reduce.SLOT_BYTES // 4 + 1))])


def _gathers(rank: int, init_method: str, out_dir: str) -> None:
    """Gathers interleaved with sums (they share the sequence numbers and slots); rank 1
    sleeps before some calls, so rank 0 waits for it there (on its futex)."""
    from worker.distributed.tensor_parallel import TensorParallel
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, WORLD, init_method, torch.device("cpu"))
    results = []
    for call, (dtype, shape) in enumerate(GATHERS):
        if rank == 1 and call % 4 == 1:
            time.sleep(0.05)
        x = _input(rank, call, dtype, math.prod(shape)).view(shape)
        results.append((tp.all_gather(x), tp.all_reduce(x.clone().flatten())))
    assert tp.shm._seq == 2 * len(GATHERS) - 2  # the oversized ones went through gloo
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def _run_group(tmp_path, target=_rank) -> list:
    context = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path}/rendezvous"
    procs = [context.Process(target=target, args=(r, init, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def test_sums_are_exact_and_identical_on_every_rank(tmp_path):
    before = {n for n in os.listdir(shm_all_reduce.SHM_DIR) if n.startswith("deltaserve-")}
    per_rank = _run_group(tmp_path)
    for call, (dtype, numel) in enumerate(CALLS):
        want = _expected(call, dtype, numel)
        for results in per_rank:
            assert results[call].dtype == dtype
            assert torch.equal(results[call], want), (call, dtype, numel)
    after = {n for n in os.listdir(shm_all_reduce.SHM_DIR) if n.startswith("deltaserve-")}
    assert after <= before  # the segment was unlinked once both ranks had mapped it


def test_switch_off_keeps_gloo(monkeypatch):
    monkeypatch.setenv(shm_all_reduce.ENV_SWITCH, "0")
    assert ShmAllReduce.create(0, 2, 1.0) is None  # before any collective: no group needed


def test_a_rank_waiting_for_a_late_peer_sleeps(tmp_path):
    """It spins ~0.1 ms, then sleeps on a futex until the peer publishes: the core is free
    for the peer (or a neighbour) meanwhile, and the answer comes as soon as the peer's."""
    waits = _run_group(tmp_path, _late_peer)[0]
    for wall, cpu in waits:
        assert wall > LATE_S / 2
        assert cpu < 0.05, f"the waiting rank used {cpu * 1e3:.0f} ms of CPU in {wall * 1e3:.0f} ms"


def test_gathers_are_exact_in_rank_order_and_wait_for_a_slow_rank(tmp_path):
    per_rank = _run_group(tmp_path, _gathers)
    for call, (dtype, shape) in enumerate(GATHERS):
        parts = [_input(r, call, dtype, math.prod(shape)).view(shape) for r in range(WORLD)]
        want = torch.cat(parts, dim=-1)
        for results in per_rank:
            gathered, summed = results[call]
            assert gathered.dtype == dtype and torch.equal(gathered, want), call
            assert torch.equal(summed, _expected(call, dtype, math.prod(shape)))

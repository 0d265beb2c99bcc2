"""Randomized soak: thousands of steps with arrivals, shared prefixes, aborts, EOS and a KV
cache small enough to preempt; every step is checked against the protocol's invariants."""
from __future__ import annotations

import os
import random

import pytest
from sched_utils import EOS_TOKEN_ID, make_scheduler
from scripted_worker import ScriptedWorker, default_script

from engine_core.engine_core import EngineCore
from engine_core.request import Request
from protocol import AbortRequests, AddRequest, SamplingParams

SEED = int(os.environ.get("SOAK_SEED", "20250"))


def _eos_script(request_id: str, tokens: list[int]) -> int:
    token = default_script(request_id, tokens)
    return EOS_TOKEN_ID if token % 23 == 0 else token


def _random_request(rng: random.Random, i: int, prefixes: list[list[int]]) -> AddRequest:
    if rng.random() < 0.15:  # an exact repeat of a shared prefix (multiples of a block too)
        prompt = rng.choice(prefixes)[:rng.choice([8, 12, 16, 23])]
    else:
        prompt = rng.choice(prefixes)[:rng.randint(0, 40)] + [
            rng.randint(3, 900) for _ in range(rng.randint(1, 30))]
    max_tokens = rng.randint(1, 40)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.2,
                            min_tokens=min(max_tokens, rng.choice([0, 0, 3])))
    return AddRequest(f"r{i}", prompt, params, arrival_time=float(i),
                      priority=rng.randint(0, 3), eos_token_id=EOS_TOKEN_ID)


def _ended_by_tokens_in_flight(request: Request, max_seq_len: int) -> bool:
    """Async scheduling: the tokens being sampled already reach max_tokens or max_seq_len."""
    pending = request.num_output_placeholders
    return pending > 0 and (request.num_output_tokens + pending >= request.max_tokens
                            or request.num_tokens + pending >= max_seq_len)


def _check_step(so, scheduler, max_tokens: int, max_seqs: int, seen_live: set[int]) -> None:
    new_ids = [r.req_id for r in so.scheduled_new_reqs]
    cached_ids = list(so.scheduled_cached_reqs.req_ids)
    scheduled = new_ids + cached_ids
    assert list(so.num_scheduled_tokens) == scheduled and len(set(scheduled)) == len(scheduled)
    assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens <= max_tokens
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    assert len(scheduler.running) <= max_seqs
    assert not set(new_ids) & seen_live, "a new request reused a live handle"
    assert set(so.scheduled_cached_reqs.resumed_req_ids) <= set(cached_ids)
    assert not set(so.preempted_req_ids) & set(scheduled)
    assert not set(so.finished_req_ids) & set(scheduled)
    if so.preempted_req_ids:
        assert not new_ids and not so.scheduled_cached_reqs.resumed_req_ids
    elif so.total_num_scheduled_tokens < max_tokens:  # budget left: no runnable request idles
        assert all(r.req_id in so.num_scheduled_tokens for r in scheduler.running
                   if not _ended_by_tokens_in_flight(r, scheduler.max_seq_len))
    seen_live.difference_update(so.finished_req_ids)
    seen_live.update(new_ids)


class _CheckedWorker(ScriptedWorker):
    """The scripted worker, checking every step message before it runs it."""

    def __init__(self, num_blocks: int, block_size: int, check,
                 sliding_windows: tuple[int, ...] = (0,)) -> None:
        super().__init__(num_blocks, block_size, script=_eos_script,
                         sliding_windows=sliding_windows)
        self.check = check

    def submit(self, so) -> None:
        self.check(so)
        super().submit(so)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy,caching,chunked,max_tokens,windows", [
    ("fcfs", True, True, 24, (0,)), ("fcfs", False, True, 24, (0,)),
    ("priority", True, True, 24, (0,)), ("fcfs", True, False, 56, (0,)),
    # Sliding-window groups (Gemma 3's kind): a full group and windows of 5 and 10 tokens.
    ("fcfs", True, True, 12, (0, 5, 10)), ("priority", False, True, 12, (0, 5))])
def test_random_soak(policy, caching, chunked, max_tokens, windows, async_scheduling):
    print(f"seed {SEED} (set SOAK_SEED to replay another)")  # pytest shows it on failure
    rng = random.Random(SEED)
    num_blocks, block_size, max_seqs = 24 * len(windows), 4, 6
    scheduler = make_scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                               num_blocks=num_blocks, block_size=block_size, policy=policy,
                               enable_prefix_caching=caching, enable_chunked_prefill=chunked,
                               max_model_len=56, async_scheduling=async_scheduling,
                               sliding_windows=windows)
    seen_live: set[int] = set()
    worker = _CheckedWorker(num_blocks, block_size, lambda so: _check_step(
        so, scheduler, max_tokens, max_seqs, seen_live), windows)
    engine = EngineCore(scheduler, worker)
    prefixes = [[rng.randint(3, 900) for _ in range(40)] for _ in range(3)]
    finished: dict[str, str] = {}
    next_id = 0

    def record(outputs) -> None:
        for out in outputs:
            if out.finish_reason == "error":  # too long for max_model_len or the whole cache
                assert "max_model_len" in out.error or "whole KV cache" in out.error
                assert out.request_id not in scheduler.requests
            if out.finish_reason:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out.finish_reason

    for step in range(2500):
        for _ in range(1 if rng.random() < 0.3 and step < 2300 else 0):
            record(engine.handle(_random_request(rng, next_id, prefixes)))
            next_id += 1
        if rng.random() < 0.03 and scheduler.requests:
            record(engine.handle(AbortRequests([rng.choice(list(scheduler.requests))])))
        record(engine.step_with_batch_queue())
        if not engine.batch_queue:
            scheduler.check_integrity()
    for _ in range(5000):
        if not engine.has_work():
            break
        record(engine.step_with_batch_queue())
    assert not scheduler.has_unfinished_requests(), "the scheduler stopped making progress"
    assert len(finished) == next_id and set(finished.values()) == {"stop", "length", "abort",
                                                                 "error"}
    assert scheduler.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1
    # Handles finished after the last step are announced with the next step, if any.
    assert sorted(worker.states) == sorted(scheduler.finished_req_ids)
    scheduler.check_integrity()

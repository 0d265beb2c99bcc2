"""Randomized soak: thousands of steps with arrivals, shared prefixes, aborts, EOS and a KV
cache small enough to preempt; every step is checked against the protocol's invariants."""
from __future__ import annotations

import random

import pytest

from engine_core.request import Request
from protocol import SamplingParams
from sched_utils import EOS_TOKEN_ID, make_scheduler
from scripted_worker import ScriptedWorker, default_script


def _eos_script(request_id: str, tokens: list[int]) -> int:
    token = default_script(request_id, tokens)
    return EOS_TOKEN_ID if token % 23 == 0 else token


def _random_request(rng: random.Random, i: int, prefixes: list[list[int]]) -> Request:
    if rng.random() < 0.15:  # an exact repeat of a shared prefix (multiples of a block too)
        prompt = rng.choice(prefixes)[:rng.choice([8, 12, 16, 23])]
    else:
        prompt = rng.choice(prefixes)[:rng.randint(0, 40)] + [
            rng.randint(3, 900) for _ in range(rng.randint(1, 30))]
    max_tokens = rng.randint(1, 40)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.2,
                            min_tokens=min(max_tokens, rng.choice([0, 0, 3])))
    return Request(f"r{i}", prompt, params, arrival_time=float(i),
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


class _Pipeline:
    """Steps the scheduler against the scripted worker, synchronously or, with async
    scheduling, with step N+1 scheduled (and run) before step N's answer is applied."""

    def __init__(self, scheduler, worker: ScriptedWorker, check) -> None:
        self.scheduler, self.worker, self.check = scheduler, worker, check
        self.depth = 2 if scheduler.async_scheduling else 1
        self.in_flight: list = []

    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.has_unfinished_requests() or s.finished_req_ids or self.in_flight)

    def step(self) -> list:
        s = self.scheduler
        if s.has_unfinished_requests() or s.finished_req_ids:
            so = s.schedule()
            self.check(so)
            self.worker.submit(so)
            self.in_flight.append(so)
            if len(self.in_flight) < self.depth:
                return []
        if not self.in_flight:
            return []
        return s.update_from_output(self.in_flight.pop(0), self.worker.collect())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy,caching,chunked,max_tokens", [
    ("fcfs", True, True, 24), ("fcfs", False, True, 24), ("priority", True, True, 24),
    ("fcfs", True, False, 56)])
def test_random_soak(policy, caching, chunked, max_tokens, async_scheduling):
    rng = random.Random(hash((policy, caching, chunked)) & 0xFFFF)
    num_blocks, block_size, max_seqs = 24, 4, 6
    scheduler = make_scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                               num_blocks=num_blocks, block_size=block_size, policy=policy,
                               enable_prefix_caching=caching, enable_chunked_prefill=chunked,
                               max_model_len=56, async_scheduling=async_scheduling)
    worker = ScriptedWorker(num_blocks, block_size, script=_eos_script)
    prefixes = [[rng.randint(3, 900) for _ in range(40)] for _ in range(3)]
    seen_live: set[int] = set()
    pipeline = _Pipeline(scheduler, worker,
                         lambda so: _check_step(so, scheduler, max_tokens, max_seqs, seen_live))
    finished: dict[str, str] = {}
    next_id = 0
    for step in range(2500):
        for _ in range(1 if rng.random() < 0.3 and step < 2300 else 0):
            request = _random_request(rng, next_id, prefixes)
            next_id += 1
            try:
                scheduler.add_request(request)
            except ValueError as e:  # too long for max_model_len or the whole cache
                assert "max_model_len" in str(e) or "whole KV cache" in str(e)
                assert request.request_id not in scheduler.requests
                finished[request.request_id] = "rejected"
        if rng.random() < 0.03 and scheduler.requests:
            victim = rng.choice(list(scheduler.requests))
            for out in scheduler.finish_requests(victim):
                finished[out.request_id] = out.finish_reason
        for out in pipeline.step():
            if out.finish_reason:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out.finish_reason
        if not pipeline.in_flight:
            scheduler.check_integrity()
    for _ in range(5000):
        if not pipeline.busy():
            break
        for out in pipeline.step():
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert not scheduler.has_unfinished_requests(), "the scheduler stopped making progress"
    assert len(finished) == next_id and set(finished.values()) == {"stop", "length", "abort",
                                                                 "rejected"}
    assert scheduler.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == num_blocks - 1 and not worker.states
    scheduler.check_integrity()

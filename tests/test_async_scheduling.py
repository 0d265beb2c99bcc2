"""Async scheduling: step N+1 is scheduled while step N runs, with the tokens still being sampled
counted as placeholders. The results must equal synchronous scheduling's, token for token."""
from __future__ import annotations

import random

import pytest
from sched_utils import EOS_TOKEN_ID, make_requests, make_scheduler, sample, scheduled_ids
from scripted_worker import ScriptedWorker, default_script

from engine_core import CacheConfig, EngineCore, Scheduler, SchedulerConfig
from protocol import AbortRequests, AddRequest, ModelRunnerOutput, SamplingParams


def _computed(so) -> dict[int, int]:
    cached = so.scheduled_cached_reqs
    return dict(zip(cached.req_ids, cached.num_computed_tokens))


def test_decode_is_scheduled_every_step_with_one_step_in_flight():
    scheduler = make_scheduler(async_scheduling=True)
    for request in make_requests(2, num_tokens=10, max_tokens=3, ignore_eos=True):
        scheduler.add_request(request)
    so1 = scheduler.schedule()  # the prompts; each samples its first token
    so2 = scheduler.schedule()  # before step 1's answer: decode the token being sampled
    assert scheduled_ids(so2, scheduler) == {"0": 1, "1": 1}
    assert _computed(so2) == {0: 10, 1: 10}
    assert [r.num_output_placeholders for r in scheduler.running] == [2, 2]
    (out, _) = scheduler.update_from_output(so1, sample(so1, scheduler))
    assert out.new_token_ids == [100] and not out.finished
    so3 = scheduler.schedule()  # 1 output known + 1 in flight < max_tokens: one more
    assert _computed(so3) == {0: 11, 1: 11}
    scheduler.update_from_output(so2, sample(so2, scheduler))
    so4 = scheduler.schedule()  # 2 known + 1 in flight = max_tokens: nothing left to run
    assert so4.total_num_scheduled_tokens == 0
    finished = scheduler.update_from_output(so3, sample(so3, scheduler))
    assert [o.finish_reason for o in finished] == ["length", "length"]
    assert scheduler.update_from_output(so4, sample(so4, scheduler)) == []
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()


def test_a_stop_token_in_flight_wastes_one_step_and_nothing_else():
    scheduler = make_scheduler(async_scheduling=True)
    (request,) = make_requests(1, num_tokens=4, max_tokens=10)
    scheduler.add_request(request)
    so1 = scheduler.schedule()
    so2 = scheduler.schedule()
    (out,) = scheduler.update_from_output(so1, sample(so1, scheduler, {"0": [EOS_TOKEN_ID]}))
    assert out.finish_reason == "stop" and out.new_token_ids == [EOS_TOKEN_ID]
    handle = so1.scheduled_new_reqs[0].req_id
    # Step 2 computed a token for the finished request; its answer is dropped.
    assert scheduler.update_from_output(so2, ModelRunnerOutput([handle], [[7]], step=2)) == []
    assert request.output_token_ids == [EOS_TOKEN_ID]
    (newcomer,) = make_requests(1, num_tokens=4)
    newcomer.request_id = "late"
    scheduler.add_request(newcomer)
    so3 = scheduler.schedule()
    assert so3.finished_req_ids == [handle]
    assert so3.scheduled_new_reqs[0].req_id != handle  # reusable only from the next step
    scheduler.check_integrity()


def _engine(async_scheduling: bool, num_blocks: int = 20, block_size: int = 4) -> EngineCore:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=96,
                             async_scheduling=async_scheduling)
    scheduler = Scheduler(config, CacheConfig(block_size, num_blocks, True))
    script = lambda rid, tokens: (EOS_TOKEN_ID if default_script(rid, tokens) % 17 == 0  # noqa: E731
                                  else default_script(rid, tokens))
    return EngineCore(scheduler, ScriptedWorker(num_blocks, block_size, script))


def _run(async_scheduling: bool, seed: int) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Random arrivals, aborts, stop tokens and preemption; (tokens, finish reasons, steps)."""
    rng = random.Random(seed)
    engine = _engine(async_scheduling)
    step = engine.step_with_batch_queue if async_scheduling else lambda: engine.step()[1]
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i in range(400):
        if i < 300 and rng.random() < 0.5:
            max_tokens = rng.randint(1, 30)
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, 2))
            prompt = [rng.randint(3, 900) for _ in range(rng.randint(1, 40))]
            engine.handle(AddRequest(f"r{i}", prompt, params, float(i), eos_token_id=EOS_TOKEN_ID))
        outputs = []
        if i % 37 == 5 and engine.scheduler.requests:  # an abort at a step boundary
            outputs += engine.handle(AbortRequests([sorted(engine.scheduler.requests)[0]]))
        _collect(outputs + step(), tokens, reasons)
    while engine.has_work():
        _collect(step(), tokens, reasons)
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 19
    return tokens, reasons, engine.scheduler.step


def _collect(outputs, tokens: dict[str, list[int]], reasons: dict[str, str]) -> None:
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            assert out.request_id not in reasons, "finished twice"
            reasons[out.request_id] = out.finish_reason


@pytest.mark.parametrize("seed", [0, 1])
def test_async_engine_produces_what_the_sync_engine_produces(seed):
    """Aborts land at different points of the two runs' requests, so compare the requests that
    were not aborted: their tokens depend only on the script."""
    sync_tokens, sync_reasons, _ = _run(False, seed)
    async_tokens, async_reasons, _ = _run(True, seed)
    kept = [r for r, why in sync_reasons.items() if why != "abort" and
            async_reasons.get(r) != "abort"]
    assert set(sync_reasons) == set(async_reasons)  # every request finished exactly once
    assert len(kept) > 50 and {sync_reasons[r] for r in kept} == {"stop", "length"}
    for request_id in kept:
        assert async_tokens[request_id] == sync_tokens[request_id], request_id
        assert async_reasons[request_id] == sync_reasons[request_id], request_id

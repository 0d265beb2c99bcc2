"""Scheduler behaviour, driven by hand-made model outputs."""
from __future__ import annotations

import pytest
from sched_utils import EOS_TOKEN_ID, make_requests, make_scheduler, sample, scheduled_ids

from engine_core.request import Request, RequestStatus
from protocol import ModelRunnerOutput, SamplingParams


def _add(scheduler, requests):
    for r in requests:
        scheduler.add_request(r)
    return requests


def test_add_and_abort_waiting():
    scheduler = make_scheduler()
    requests = _add(scheduler, make_requests(10))
    assert len(scheduler.waiting) == 10 and scheduler.get_num_unfinished_requests() == 10
    for i, r in enumerate(requests):
        outputs = scheduler.finish_requests(r.request_id)
        assert outputs[0].finish_reason == "abort" and r.status == RequestStatus.FINISHED_ABORTED
        assert r.request_id not in scheduler.requests and len(scheduler.waiting) == 9 - i
    assert scheduler.finished_req_ids == []  # never scheduled: workers never knew them
    assert scheduler.finish_requests(["unknown"]) == []


def test_schedule_new_requests_in_full():
    scheduler = make_scheduler(enable_prefix_caching=True)
    requests = _add(scheduler, make_requests(10))
    so = scheduler.schedule()
    assert [r.request_id for r in so.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert so.scheduled_cached_reqs.num_reqs == 0 and so.step == 1
    assert scheduled_ids(so, scheduler) == {str(i): 10 for i in range(10)}
    assert so.total_num_scheduled_tokens == 100
    new0 = so.scheduled_new_reqs[0]
    assert new0.prompt_token_ids == [0] * 10 and new0.block_ids == [1]
    assert new0.num_computed_tokens == 0 and new0.eos_token_id == EOS_TOKEN_ID
    assert scheduler.running == requests and len(scheduler.waiting) == 0
    assert sorted(r.req_id for r in requests) == list(range(10))


def test_cached_requests_carry_only_deltas():
    scheduler = make_scheduler(block_size=4)
    (req,) = _add(scheduler, make_requests(1, num_tokens=7, max_tokens=10))
    so = scheduler.schedule()
    scheduler.update_from_output(so, sample(so, scheduler))
    so = scheduler.schedule()  # decode of the 8th token: still fits block 2
    cached = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == [] and cached.req_ids.tolist() == [req.req_id]
    assert cached.num_computed_tokens.tolist() == [7] and cached.new_block_ids == [None]
    scheduler.update_from_output(so, sample(so, scheduler))
    so = scheduler.schedule()  # the 9th token needs a third block
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]
    assert so.scheduled_cached_reqs.num_computed_tokens.tolist() == [8]


def test_chunked_prefill_with_threshold():
    scheduler = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    requests = _add(scheduler, make_requests(3, num_tokens=800))
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens.values()) == [400, 400, 224]
    assert all(tokens == [] for tokens in sample(so, scheduler).sampled_token_ids)
    scheduler.update_from_output(so, sample(so, scheduler))
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens.values()) == [400, 400, 224]
    assert so.scheduled_cached_reqs.req_ids.tolist() == [r.req_id for r in requests]
    outputs = scheduler.update_from_output(so, sample(so, scheduler))
    assert [o.request_id for o in outputs] == ["0", "1"]  # they reached the prompt's end
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens.values()) == [1, 1, 352]


@pytest.mark.parametrize("chunked", [True, False])
def test_schedule_order_without_skipping_ahead(chunked):
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=1024,
                               enable_chunked_prefill=chunked)
    _add(scheduler, make_requests(2, num_tokens=800))
    _add(scheduler, [Request(f"short{i}", [1] * 10, SamplingParams()) for i in range(2)])
    so = scheduler.schedule()
    expected = {"0": 800, "1": 224} if chunked else {"0": 800}
    assert scheduled_ids(so, scheduler) == expected


def test_stop_conditions():
    scheduler = make_scheduler()
    reqs = _add(scheduler, make_requests(2, num_tokens=4, max_tokens=100))
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(
        so, sample(so, scheduler, {"0": [EOS_TOKEN_ID], "1": [10]}))
    assert outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == [EOS_TOKEN_ID]
    assert outputs[0].stop_reason is None and reqs[0].status == RequestStatus.FINISHED_STOPPED
    assert outputs[1].finish_reason is None and reqs[1].status == RequestStatus.RUNNING
    so = scheduler.schedule()
    assert so.finished_req_ids == [reqs[0].req_id]

    scheduler = make_scheduler()
    (req,) = _add(scheduler, make_requests(1, stop_token_ids=[42, 43], max_tokens=100))
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(so, sample(so, scheduler, {"0": [10, 42, 12]}))
    assert out.new_token_ids == [10, 42] and out.stop_reason == 42 and out.finish_reason == "stop"
    assert req.output_token_ids == [10, 42]

    scheduler = make_scheduler()
    (req,) = _add(scheduler, make_requests(1, max_tokens=2))
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(so, sample(so, scheduler, {"0": [10, 11, 12]}))
    assert out.finish_reason == "length" and req.output_token_ids == [10, 11]

    scheduler = make_scheduler()
    (req,) = _add(scheduler, make_requests(1, ignore_eos=True, max_tokens=100))
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(
        so, sample(so, scheduler, {"0": [EOS_TOKEN_ID, 10, 11]}))
    assert out.finish_reason is None and req.output_token_ids == [EOS_TOKEN_ID, 10, 11]


@pytest.mark.parametrize("stop_token", [EOS_TOKEN_ID, 42])
def test_min_tokens_defers_stop(stop_token):
    scheduler = make_scheduler()
    (req,) = _add(scheduler, make_requests(1, min_tokens=5, stop_token_ids=[42], max_tokens=50))
    so = scheduler.schedule()
    out = scheduler.update_from_output(so, sample(so, scheduler, {"0": [1, 2, stop_token]}))
    assert out[0].finish_reason is None and req.num_output_tokens == 3
    so = scheduler.schedule()
    out = scheduler.update_from_output(so, sample(so, scheduler, {"0": [4, stop_token]}))
    assert out[0].finish_reason == "stop" and req.num_output_tokens == 5


def test_max_model_len_caps_length_and_rejects_long_prompts():
    scheduler = make_scheduler(max_model_len=12, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="max_model_len=12"):
        scheduler.add_request(Request("long", [1] * 12, SamplingParams()))
    assert not scheduler.has_unfinished_requests()
    (req,) = _add(scheduler, make_requests(1, num_tokens=10, max_tokens=100))
    for _ in range(2):
        so = scheduler.schedule()
        assert all(n <= 12 - 1 for n in so.num_scheduled_tokens.values())
        outputs = scheduler.update_from_output(so, sample(so, scheduler))
    assert outputs[0].finish_reason == "length" and req.num_tokens == 12


def test_prompt_larger_than_cache_is_rejected():
    scheduler = make_scheduler(num_blocks=5, block_size=16)
    with pytest.raises(ValueError, match="whole KV cache has 4"):
        scheduler.add_request(Request("big", [1] * 65, SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("empty", [], SamplingParams()))
    scheduler.add_request(Request("ok", [1] * 64, SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("ok", [1], SamplingParams()))
    assert list(scheduler.requests) == ["ok"]


def test_preempt_during_execution_keeps_handle_and_resumes_with_new_blocks():
    scheduler = make_scheduler(num_blocks=11, max_num_batched_tokens=100,
                               enable_prefix_caching=True)
    req0, req1 = _add(scheduler, make_requests(2, num_tokens=80, max_tokens=5))
    so0 = scheduler.schedule()
    assert scheduled_ids(so0, scheduler) == {"0": 80, "1": 20}
    so1 = scheduler.schedule()  # req1's remaining 60 before req0's output arrives
    assert scheduled_ids(so1, scheduler) == {"1": 60}
    scheduler.update_from_output(so0, sample(so0, scheduler))
    so2 = scheduler.schedule()  # req0 needs a 6th block: the tail (req1) is preempted
    assert so2.preempted_req_ids == [req1.req_id] and scheduler.running == [req0]
    assert req1.status == RequestStatus.PREEMPTED and req1.num_computed_tokens == 0
    assert scheduled_ids(so2, scheduler) == {"0": 1}
    scheduler.update_from_output(so1, sample(so1, scheduler, {"1": [42]}))  # late output
    assert req1.output_token_ids == [42]  # the workers sampled it, so it counts

    while req0.status == RequestStatus.RUNNING:
        scheduler.update_from_output(so2, sample(so2, scheduler))
        so2 = scheduler.schedule()
    cached = so2.scheduled_cached_reqs
    assert so2.scheduled_new_reqs == [] and cached.req_ids.tolist() == [req1.req_id]
    assert cached.resumed_req_ids == [req1.req_id]  # same handle, known to the workers
    assert cached.new_block_ids[0] == scheduler.kv_cache_manager.get_block_ids("1")
    assert cached.num_computed_tokens.tolist() == [64]  # hit on its freed blocks; req0 took the last
    assert so2.finished_req_ids == [req0.req_id]


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    a, b = _add(scheduler, make_requests(2, num_tokens=12, max_tokens=20))
    so = scheduler.schedule()
    scheduler.update_from_output(so, sample(so, scheduler))
    scheduler.add_request(Request("late", [9], SamplingParams()))
    so = scheduler.schedule()  # a and b each need a 4th block; only 0 free -> b preempted
    assert so.preempted_req_ids == [b.req_id] and so.scheduled_new_reqs == []
    assert [r.request_id for r in scheduler.waiting] == ["1", "late"]


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    _add(scheduler, make_requests(5))
    so = scheduler.schedule()
    assert len(so.scheduled_new_reqs) == 2 and len(scheduler.waiting) == 3


def test_identical_prompts_in_one_step_share_blocks():
    scheduler = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=1000)
    _add(scheduler, make_requests(2, num_tokens=100, same_prompt=True))
    so = scheduler.schedule()
    assert scheduled_ids(so, scheduler) == {"0": 100, "1": 100 % 16}
    assert so.scheduled_new_reqs[1].num_computed_tokens == 96
    assert so.scheduled_new_reqs[1].block_ids[:6] == so.scheduled_new_reqs[0].block_ids[:6]


def test_multi_turn_reuses_the_previous_turn():
    scheduler = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=1000)
    (req,) = _add(scheduler, make_requests(1, num_tokens=100, max_tokens=200))
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        scheduler.update_from_output(so, sample(so, scheduler, default=7))
    turn2 = Request("turn2", req.all_token_ids, SamplingParams())
    scheduler.add_request(turn2)
    so = scheduler.schedule()
    assert scheduled_ids(so, scheduler) == {"turn2": 300 % 16}


def test_handles_are_recycled_after_the_workers_heard():
    scheduler = make_scheduler()
    first, second = _add(scheduler, make_requests(2, max_tokens=1))
    so = scheduler.schedule()
    scheduler.update_from_output(so, sample(so, scheduler))
    (third,) = _add(scheduler, [Request("x", [1, 2], SamplingParams())])
    so = scheduler.schedule()
    assert so.finished_req_ids == [0, 1]
    assert third.req_id == 2  # 0 and 1 are reusable only after this message
    (fourth,) = _add(scheduler, [Request("y", [1], SamplingParams())])
    scheduler.update_from_output(so, sample(so, scheduler))
    so = scheduler.schedule()
    assert fourth.req_id == 0


def test_memory_is_released_at_the_end():
    scheduler = make_scheduler(enable_prefix_caching=True)
    _add(scheduler, make_requests(5, max_tokens=10))
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        scheduler.update_from_output(so, sample(so, scheduler))
    scheduler.schedule()  # announce the last finished handles
    assert not scheduler.requests and not scheduler.running and not scheduler.finished_req_ids
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks and not kv.num_cached_block
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    scheduler.check_integrity()


def test_abort_running_request_is_announced():
    scheduler = make_scheduler()
    (req,) = _add(scheduler, make_requests(1))
    scheduler.schedule()
    (out,) = scheduler.finish_requests("0")
    assert out.finish_reason == "abort" and scheduler.running == []
    assert scheduler.schedule().finished_req_ids == [req.req_id]


def test_update_ignores_partial_chunks_and_unknown_handles():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_model_len=100)
    _add(scheduler, make_requests(1, num_tokens=20))
    so = scheduler.schedule()
    assert scheduler.update_from_output(so, ModelRunnerOutput([0, 99], [[], [5]])) == []


def test_new_prompts_per_step_fit_one_step_message(monkeypatch):
    """Every new request's prompt travels in full in its first step: the step admits new
    prompts only up to MAX_NEW_PROMPT_TOKENS (one always goes), so no step message can
    outgrow what a worker accepts."""
    scheduler = make_scheduler()
    monkeypatch.setattr("engine_core.sched.admission.MAX_NEW_PROMPT_TOKENS", 25)
    _add(scheduler, make_requests(5, num_tokens=10))
    counts = []
    while scheduler.waiting:
        so = scheduler.schedule()
        counts.append(len(so.scheduled_new_reqs))
        scheduler.update_from_output(so, sample(so, scheduler))
    assert counts == [2, 2, 1]
    scheduler.check_integrity()

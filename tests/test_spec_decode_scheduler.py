"""Speculative decoding in the scheduler: drafts as extra tokens of a request, rollback of the
rejected ones, prefix caching, preemption, stops and adaptivity (hand-made model outputs)."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
from sched_utils import EOS_TOKEN_ID, make_scheduler

from engine_core.request import Request
from engine_core.spec_decode.draft_state import DraftState
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol import (
    Channel,
    Codec,
    DraftTokens,
    EngineConfig,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    SpecDecodeSchedulerOutput,
    SpeculativeConfig,
)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=2)


def _scheduler(spec=NGRAM, **kwargs):
    kwargs = {"block_size": 4, "enable_prefix_caching": True, **kwargs}
    return make_scheduler(speculative_config=spec, **kwargs)


def _request(rid: str, prompt: list[int], max_tokens: int = 32, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=float(len(rid)), eos_token_id=EOS_TOKEN_ID)


def _answer(so: SchedulerOutput, tokens: dict[int, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [tokens.get(h, []) for h in req_ids], step=so.step)


def _step(scheduler, tokens_by_request: dict[str, list[int]]):
    so = scheduler.schedule()
    by_handle = {scheduler.requests[r].req_id: t for r, t in tokens_by_request.items()
                 if r in scheduler.requests}
    outputs = scheduler.update_from_output(so, _answer(so, by_handle))
    scheduler.check_integrity()
    return so, {o.request_id: o for o in outputs}


# --- proposing ------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 2, 3], 4, [4, 2, 3]),  # suffix [2, 3] occurred before: what followed it
    ([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, [7, 5, 2]),  # the most recent of equal matches
    ([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 3, [9, 5, 2]),  # the longest match wins
    ([1, 2, 3, 4, 2, 3], 1, [4]),  # at most k
    ([7, 1, 2], 4, []),  # no earlier occurrence
    ([5, 5, 5, 5], 4, [5]),  # the most recent occurrence ends just before the suffix
])
def test_ngram_proposals(tokens, k, expected):
    assert NgramProposer(2, 3).propose(np.array(tokens, np.int32), k) == expected


def test_ngram_minimum_length():
    tokens = np.array([4, 1, 2, 9, 2], np.int32)  # only a 1-token match ([2])
    assert NgramProposer(1, 3).propose(tokens, 2) == [9, 2]
    assert NgramProposer(2, 3).propose(tokens, 2) == []


def test_draft_length_follows_acceptance_and_batch_size():
    state = DraftState(8)
    # A first guess of 0.7 per token: far alone, a little in a batch of 16, not at all in 256
    # (a draft token then costs about what it is likely to save).
    assert [state.next_length(batch) for batch in (1, 4, 16)] == [6, 3, 2]
    for _ in range(4):
        state.observe(8, 8)
    assert state.next_length(16) == state.next_length(256) == 8  # its text follows its drafts
    state.observe(8, 2)
    assert state.next_length(1) == 8 and state.next_length(16) == 2
    for _ in range(5):
        state.observe(2, 0)
    # Rejected outright: no proposals in a batch of 16, but a one-token probe after 1, 2, 4
    # steps without one.
    assert [state.next_length(16) for _ in range(7)] == [1, 0, 1, 0, 0, 0, 1]
    state.observe(1, 1)
    assert state.probe_interval == 1 and state.next_length(1) > 1


# --- scheduling and rollback -----------------------------------------------------------------

def test_drafts_are_extra_tokens_and_rejected_ones_roll_back():
    scheduler = _scheduler()
    request = _request("a", [1, 2, 3, 1, 2])
    scheduler.add_request(request)
    so, _ = _step(scheduler, {"a": [3]})  # prefill; then [.., 2, 3] proposes [1, 2, 3]
    assert type(so) is SchedulerOutput and request.spec_token_ids == [1, 2, 3]
    so, outputs = _step(scheduler, {"a": [1, 9]})  # first draft accepted, then the target's 9
    assert isinstance(so, SpecDecodeSchedulerOutput)
    assert so.scheduled_spec_decode_tokens.as_dict() == {request.req_id: [1, 2, 3]}
    assert so.total_num_scheduled_tokens == 4 and so.scheduled_cached_reqs.num_computed_tokens \
        .tolist() == [5]
    assert outputs["a"].new_token_ids == [1, 9]
    assert request.all_token_ids == [1, 2, 3, 1, 2, 3, 1, 9]
    assert request.num_computed_tokens == 7  # 5 + 4 scheduled - 2 rejected
    stats = scheduler.get_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)


def test_budget_keeps_a_prefix_of_the_drafts():
    scheduler = _scheduler(max_num_batched_tokens=3, max_model_len=64)
    request = _request("a", [1, 2, 3, 1, 2])
    scheduler.add_request(request)
    _step(scheduler, {})  # a chunk of 3 prompt tokens
    _step(scheduler, {"a": [3]})  # the other 2; then proposes [1, 2, 3]
    assert request.spec_token_ids == [1, 2, 3]
    so, _ = _step(scheduler, {"a": [1, 2, 5]})  # 1 known token and 2 drafts fit the budget
    assert so.scheduled_spec_decode_tokens.as_dict() == {request.req_id: [1, 2]}
    assert so.total_num_scheduled_tokens == 3 and request.num_computed_tokens == 8


def test_only_accepted_tokens_reach_the_prefix_cache():
    scheduler = _scheduler()
    request = _request("a", [1, 2, 3, 1, 2], max_tokens=12)
    scheduler.add_request(request)
    _step(scheduler, {"a": [3]})
    for answer in ([7], [8, 8], [5], [1, 2], [6]):  # every draft rejected at once
        so, _ = _step(scheduler, {"a": answer})
    pool = scheduler.kv_cache_manager.block_pool
    published = set(pool.cached_block_hash_to_block)
    assert published and published <= set(request.block_hashes)
    # Every published block's hash is the chain of the request's own (accepted) tokens.
    twin = Request("twin", request.all_token_ids, SamplingParams())
    scheduler.kv_cache_manager._extend_block_hashes(twin, request.num_tokens // 4)
    assert published <= set(twin.block_hashes)


def test_preempted_requests_drop_their_proposals():
    scheduler = _scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    a, b = _request("a", [1, 2, 1, 2, 1]), _request("bb", [1, 2, 1])
    scheduler.add_request(a)
    scheduler.add_request(b)
    _step(scheduler, {"a": [2], "bb": [2]})
    assert a.spec_token_ids and b.spec_token_ids
    so = scheduler.schedule()  # a's drafts need a third block: bb is preempted
    assert so.preempted_req_ids == [b.req_id] and b.spec_token_ids == []
    assert list(so.scheduled_spec_decode_tokens.as_dict()) == [a.req_id]
    assert scheduler.table.num_spec[b.req_id] == 0
    scheduler.update_from_output(so, _answer(so, {a.req_id: [1]}))
    scheduler.check_integrity()


def test_stop_token_inside_an_accepted_run_cuts_there():
    scheduler = _scheduler()
    request = _request("a", [1, 2, 3, 1, 2])
    scheduler.add_request(request)
    _step(scheduler, {"a": [3]})
    _, outputs = _step(scheduler, {"a": [1, EOS_TOKEN_ID, 3]})
    assert outputs["a"].new_token_ids == [1, EOS_TOKEN_ID]
    assert outputs["a"].finish_reason == "stop" and "a" not in scheduler.requests


def test_max_tokens_is_never_exceeded():
    scheduler = _scheduler()
    request = _request("a", [1, 2, 3, 1, 2], max_tokens=3)
    scheduler.add_request(request)
    _step(scheduler, {"a": [3]})
    assert request.spec_token_ids == [1]  # room for 2 more tokens: one draft and its bonus
    _, outputs = _step(scheduler, {"a": [1, 2]})
    assert outputs["a"].finish_reason == "length" and request.output_token_ids == [3, 1, 2]


def test_min_tokens_holds_eos_inside_a_run():
    scheduler = _scheduler()
    request = _request("a", [1, 2, 3, 1, 2], min_tokens=4)
    scheduler.add_request(request)
    _step(scheduler, {"a": [3]})
    _, outputs = _step(scheduler, {"a": [EOS_TOKEN_ID, 2]})  # 2 outputs: EOS does not stop
    assert outputs["a"].finish_reason is None


def test_rejected_proposals_back_off():
    scheduler = _scheduler(max_model_len=512)
    request = _request("a", [1, 2] * 8, max_tokens=200)
    scheduler.add_request(request)
    drafted = 0
    for i in range(120):  # the target never follows the proposals
        so, _ = _step(scheduler, {"a": [1 if i % 2 else 2]})
        spec = so.scheduled_spec_decode_tokens
        drafted += sum(spec.num_tokens) if spec is not None else 0
    assert drafted < 40  # of up to 3 per step: backed off, then paused for longer and longer


def test_without_proposals_the_step_messages_are_those_of_speculation_off():
    frames = []
    for spec in (None, NGRAM):
        scheduler = _scheduler(spec)
        scheduler.add_request(_request("a", [1, 2, 3, 4], max_tokens=6))
        codec, out = Codec(Channel.CORE_TO_WORKER), []
        for token in (5, 6, 7, 8, 9, 10):  # never a repeated token: nothing to propose
            so, _ = _step(scheduler, {"a": [token]})
            out.append(bytes(codec.encode(so)))
        frames.append(out)
    assert frames[0] == frames[1]


# --- draft model: proposals come from the workers ---------------------------------------------

def test_draft_model_proposals_and_lookahead():
    spec = SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=3)
    scheduler = _scheduler(spec)
    request = _request("a", [9, 8, 7, 6])
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.num_spec_tokens_to_propose.tolist() == [3]  # proposed after the prefill
    answer = _answer(so, {request.req_id: [4]})
    answer.draft_token_ids = DraftTokens.from_lists([request.req_id], [[1, 2, 3]])
    scheduler.update_from_output(so, answer)
    assert request.spec_token_ids == [1, 2, 3]
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens.as_dict() == {request.req_id: [1, 2, 3]}
    # Slots for positions 4..7 (a known token, 3 drafts) and 3 lookahead ones: 3 blocks.
    assert scheduler.kv_cache_manager.num_slots("a") == 12
    scheduler.update_from_output(so, _answer(so, {request.req_id: [1, 2, 3, 0]}))
    scheduler.check_integrity()
    assert request.num_computed_tokens == 8 and request.num_tokens == 9


# --- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens must be in"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "above prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "belongs to"),
    ({"method": "ngram", "num_speculative_tokens": 2, "top": 1}, "unknown field"),
])
def test_bad_configs_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(model="m", speculative_config=options)


def test_async_scheduling_is_refused_with_speculation():
    with pytest.raises(ValueError, match="does not work with async_scheduling"):
        EngineConfig.create(model="m", async_scheduling=True,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_config_round_trips_as_json():
    config = EngineConfig.create(model="m", speculative_config='{"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert config.speculative_config.lookup_min == config.speculative_config.lookup_max == 3
    again = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert again == config

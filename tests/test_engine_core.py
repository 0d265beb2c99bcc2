"""EngineCore: the socket-free step loop, driven through protocol messages."""
from __future__ import annotations

import random

from scripted_worker import ScriptedWorker

from engine_core import CacheConfig, EngineCore, Scheduler, SchedulerConfig
from protocol import AbortRequests, AddRequest, Channel, Codec, SamplingParams


def _engine(num_blocks: int = 64, block_size: int = 4, **sched) -> EngineCore:
    config = SchedulerConfig(max_num_batched_tokens=32, max_model_len=128, **sched)
    scheduler = Scheduler(config, CacheConfig(block_size, num_blocks, True))
    return EngineCore(scheduler, ScriptedWorker(num_blocks, block_size))


def _add(i: int, prompt: list[int], **params) -> AddRequest:
    return AddRequest(f"req-{i}", prompt, SamplingParams(**params), arrival_time=float(i),
                      eos_token_id=0)


def test_requests_run_to_completion():
    engine = _engine()
    for i in range(5):
        assert engine.handle(_add(i, [i + 1] * (3 + 7 * i), max_tokens=6, ignore_eos=True)) == []
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_work():
        _, outputs = engine.step()
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {f"req-{i}": "length" for i in range(5)}
    assert all(len(t) == 6 for t in tokens.values())
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_rejected_and_aborted_requests_leave_the_rest_running():
    engine = _engine(num_blocks=8)
    (bad,) = engine.handle(_add(0, [1] * 200))
    assert bad.finish_reason == "error" and "max_model_len" in bad.error
    (too_big,) = engine.handle(_add(1, [1] * 40))
    assert too_big.finish_reason == "error" and "KV cache" in too_big.error
    engine.handle(_add(2, [5, 6, 7], max_tokens=50, ignore_eos=True))
    engine.handle(_add(3, [8, 9], max_tokens=3, ignore_eos=True))
    engine.step()
    (aborted,) = engine.handle(AbortRequests(["req-2", "nope"]))
    assert aborted.finish_reason == "abort"
    finished = {}
    while engine.has_work():
        for out in engine.step()[1]:
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"req-3": "length"}


def _run_stream(seed: int) -> list[bytes]:
    """Encoded step messages of a run with random arrivals and aborts."""
    rng = random.Random(seed)
    engine = _engine(num_blocks=20)
    codec = Codec(Channel.CORE_TO_WORKER)
    frames = []
    for step in range(300):
        if step < 200 and rng.random() < 0.4:
            prompt = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
            engine.handle(_add(step, prompt, max_tokens=rng.randint(1, 20)))
        if rng.random() < 0.05 and engine.scheduler.requests:
            engine.handle(AbortRequests([rng.choice(sorted(engine.scheduler.requests))]))
        if engine.has_work():
            so, _ = engine.step()
            frames.append(bytes(codec.encode(so)))
    return frames


def test_same_inputs_give_byte_identical_step_stream():
    first, second = _run_stream(7), _run_stream(7)
    assert len(first) > 100 and first == second
    assert _run_stream(8) != first

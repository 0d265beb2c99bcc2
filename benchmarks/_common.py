"""Helpers shared by the benchmark scripts (timing and a decode-only scheduler setup)."""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine_core import CacheConfig, Request, Scheduler, SchedulerConfig  # noqa: E402
from protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput  # noqa: E402


def median_us(fn: Callable[[], object], repeat: int = 2000, rounds: int = 7) -> float:
    """Median over `rounds` of the mean time of `repeat` calls, in microseconds."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(samples)


def decode_scheduler(num_requests: int, prompt_len: int = 1000,
                     block_size: int = 16) -> Scheduler:
    """A scheduler whose `num_requests` requests have all finished their prefill."""
    blocks_per_req = (prompt_len + 4096) // block_size + 2
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=1 << 20,
                        max_model_len=1 << 16),
        CacheConfig(block_size, num_requests * blocks_per_req + 1, True))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i)))
    step(scheduler)
    return scheduler


def one_token_each(so: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [[7]] * len(req_ids), step=so.step)


def step(scheduler: Scheduler) -> SchedulerOutput:
    so = scheduler.schedule()
    scheduler.update_from_output(so, one_token_each(so))
    return so

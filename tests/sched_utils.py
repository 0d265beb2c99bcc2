"""Factories for scheduler tests (CPU only, no model)."""
from __future__ import annotations

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput, SpeculativeConfig

EOS_TOKEN_ID = 50256


def make_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192,
                   enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
                   long_prefill_token_threshold: int = 0, num_blocks: int = 10000,
                   block_size: int = 16, max_model_len: int | None = None,
                   policy: str = "fcfs", async_scheduling: bool = False,
                   speculative_config: SpeculativeConfig | None = None,
                   sliding_windows: tuple[int, ...] = (0,)) -> Scheduler:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len or max_num_batched_tokens,
                            policy=policy,
                            long_prefill_token_threshold=long_prefill_token_threshold,
                            enable_chunked_prefill=enable_chunked_prefill,
                            async_scheduling=async_scheduling,
                            speculative_config=speculative_config)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                        enable_prefix_caching=enable_prefix_caching,
                        sliding_windows=sliding_windows)
    return Scheduler(sched, cache)


def make_requests(num_requests: int, num_tokens: int = 10, max_tokens: int = 16,
                  ignore_eos: bool = False, stop_token_ids: list[int] | None = None,
                  same_prompt: bool = False, min_tokens: int = 0,
                  priorities: list[int] | None = None,
                  arrival_times: list[float] | None = None) -> list[Request]:
    """Request i has prompt `[i] * num_tokens` (or all zeros) and id `str(i)`."""
    requests = []
    for i in range(num_requests):
        params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens,
                                stop_token_ids=stop_token_ids, min_tokens=min_tokens)
        requests.append(Request(str(i), [0 if same_prompt else i] * num_tokens, params,
                                arrival_time=arrival_times[i] if arrival_times else float(i),
                                priority=priorities[i] if priorities else 0,
                                eos_token_id=EOS_TOKEN_ID))
    return requests


def sample(so: SchedulerOutput, scheduler: Scheduler,
           tokens: dict[str, list[int]] | None = None, default: int = 100) -> ModelRunnerOutput:
    """A model output for `so`: `tokens[request_id]` where given, else one `default` token
    for each request whose scheduled tokens reach the end of its sequence."""
    before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    req_ids, sampled = [], []
    for req_id, n in so.num_scheduled_tokens.items():
        request = scheduler.requests_by_handle[req_id]
        req_ids.append(req_id)
        if tokens is not None and request.request_id in tokens:
            sampled.append(tokens[request.request_id])
        else:
            done = before[req_id] + n >= request.num_tokens
            sampled.append([default] if done else [])
    return ModelRunnerOutput(req_ids, sampled, step=so.step)


def scheduled_ids(so: SchedulerOutput, scheduler: Scheduler) -> dict[str, int]:
    """request_id -> scheduled tokens, in step order."""
    return {scheduler.requests_by_handle[h].request_id: n
            for h, n in so.num_scheduled_tokens.items()}

"""The engine's step logic without any transport: the one seam for tests, offline use and replay."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.engine_config import EngineConfig
from protocol.engine_messages import AbortRequests, AddRequest, AddRequests, EngineCoreOutput
from protocol.kv_events import KVEvent
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput


class ModelExecutor(Protocol):
    """Runs one step on the workers and returns rank 0's answer."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class PipelinedExecutor(ModelExecutor, Protocol):
    """Also takes a step without waiting for it; answers come back in submission order."""

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...


class EngineCore:
    """Adds and aborts requests and runs steps: schedule, execute, update."""

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor,
                 max_logprobs: int = 20) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_logprobs = max_logprobs
        self.batch_queue: deque[SchedulerOutput] = deque()  # submitted, not yet collected
        # Two at most: the scheduler reuses a finished request's handle on the assumption
        # that at most one step is in flight while it schedules (see Scheduler.schedule).
        self.batch_queue_size = 2 if scheduler.async_scheduling else 1

    @staticmethod
    def from_config(config: EngineConfig, executor: ModelExecutor | None, num_blocks: int,
                    max_model_len: int, vocab_size: int | None) -> EngineCore:
        """The engine core for `config` once the workers reported their capacity (also what a
        scheduler-only replay builds, so both decide alike)."""
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.token_budget(max_model_len),
                            max_model_len=max_model_len, policy=config.policy,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            async_scheduling=config.async_scheduling),
            CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching),
            vocab_size)
        return EngineCore(scheduler, executor, config.max_logprobs)

    def record_kv_events(self) -> None:
        """Log the prefix cache's changes as KV-cache events (before the first step)."""
        manager = self.scheduler.kv_cache_manager
        manager.block_pool.record_kv_events(manager.block_size)

    def take_kv_events(self) -> list[KVEvent]:
        """The KV-cache events since the last call (none unless recorded)."""
        return self.scheduler.kv_cache_manager.block_pool.take_kv_events()

    def add_request(self, message: AddRequest) -> list[EngineCoreOutput]:
        """Queue a request; a request that can never run finishes at once with an error."""
        request = Request(message.request_id, message.prompt_token_ids, message.sampling_params,
                          message.arrival_time, message.priority, message.eos_token_id)
        try:
            logprobs = message.sampling_params.logprobs
            if logprobs is not None and logprobs > self.max_logprobs:
                raise ValueError(f"logprobs must be at most {self.max_logprobs} (the engine's "
                                 f"max_logprobs), got {logprobs}")
            self.scheduler.add_request(request)
        except ValueError as e:
            return [EngineCoreOutput(message.request_id, [], "error", error=str(e))]
        return []

    def abort_requests(self, message: AbortRequests) -> list[EngineCoreOutput]:
        return self.scheduler.finish_requests(message.request_ids)

    def handle(self, message: AddRequest | AddRequests | AbortRequests) -> list[EngineCoreOutput]:
        if isinstance(message, AddRequest):
            return self.add_request(message)
        if isinstance(message, AddRequests):
            return [out for request in message.requests for out in self.add_request(request)]
        return self.abort_requests(message)

    def has_work(self) -> bool:
        """Unfinished requests, or steps in flight. Handles that finished since the last step
        are announced in the next real step, never in an empty one whose timing would depend
        on the clock."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One synchronous step (schedule, execute, update) and the step message it ran: the
        seam unit tests, tools and benchmarks drive (vLLM's `EngineCore.step`). The process
        loop calls `step_with_batch_queue`, which with a queue of one does the same."""
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return scheduler_output, self.scheduler.update_from_output(scheduler_output,
                                                                   model_runner_output)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """One call of the step loop: schedule and submit the next step if there is work and
        room in the queue, then collect the oldest step once the queue is full (or nothing
        else can be scheduled). With a queue of one this is `step()`; with two (async
        scheduling) the workers run step N+1 while step N's answer is applied."""
        if self.scheduler.has_unfinished_requests() and len(self.batch_queue) < \
                self.batch_queue_size:
            scheduler_output = self.scheduler.schedule()
            self.executor.submit(scheduler_output)  # type: ignore[attr-defined]
            self.batch_queue.append(scheduler_output)
            if len(self.batch_queue) < self.batch_queue_size:
                return []
        return self._collect_oldest() if self.batch_queue else []

    def finish_in_flight(self) -> list[EngineCoreOutput]:
        """Collect every step in flight (before shutting down, so each sent step has its
        answer in the journal)."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            outputs += self._collect_oldest()
        return outputs

    def _collect_oldest(self) -> list[EngineCoreOutput]:
        executor: PipelinedExecutor = self.executor  # type: ignore[assignment]
        return self.scheduler.update_from_output(self.batch_queue.popleft(), executor.collect())

"""The engine's step logic without any transport: the one seam for tests, offline use and replay."""
from __future__ import annotations

from typing import Protocol

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from protocol.engine_config import EngineConfig
from protocol.engine_messages import AbortRequests, AddRequest, AddRequests, EngineCoreOutput
from protocol.model_runner_output import ModelRunnerOutput
from protocol.scheduler_output import SchedulerOutput


class ModelExecutor(Protocol):
    """Runs one step on the workers and returns rank 0's answer."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Adds and aborts requests and runs steps: schedule, execute, update."""

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor,
                 vocab_size: int | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = vocab_size  # when known, prompts with ids beyond it are refused

    @staticmethod
    def from_config(config: EngineConfig, executor: ModelExecutor | None, num_blocks: int,
                    max_model_len: int, vocab_size: int | None) -> EngineCore:
        """The engine core for `config` once the workers reported their capacity (also what a
        scheduler-only replay builds, so both decide alike)."""
        budget = config.max_num_batched_tokens or max(
            8192, 0 if config.enable_chunked_prefill else max_model_len)
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, policy=config.policy,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            enable_chunked_prefill=config.enable_chunked_prefill),
            CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching))
        return EngineCore(scheduler, executor, vocab_size)

    def add_request(self, message: AddRequest) -> list[EngineCoreOutput]:
        """Queue a request; a request that can never run finishes at once with an error."""
        request = Request(message.request_id, message.prompt_token_ids, message.sampling_params,
                          message.arrival_time, message.priority, message.eos_token_id)
        try:
            if self.vocab_size and max(message.prompt_token_ids, default=0) >= self.vocab_size:
                raise ValueError(f"prompt token id {max(message.prompt_token_ids)} is outside "
                                 f"the vocabulary (size {self.vocab_size})")
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
        """Unfinished requests. Handles that finished since the last step are announced in the
        next real step, never in an empty one whose timing would depend on the clock."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return scheduler_output, self.scheduler.update_from_output(scheduler_output,
                                                                   model_runner_output)

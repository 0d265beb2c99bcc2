"""The engine's step logic without any transport: the one seam for tests, offline use and replay."""
from __future__ import annotations

from typing import Protocol

from engine_core.request import Request
from engine_core.scheduler import Scheduler
from protocol.engine_messages import AbortRequests, AddRequest, EngineCoreOutput
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

    def handle(self, message: AddRequest | AbortRequests) -> list[EngineCoreOutput]:
        if isinstance(message, AddRequest):
            return self.add_request(message)
        return self.abort_requests(message)

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones the workers have not been told about yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.finished_req_ids)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return scheduler_output, self.scheduler.update_from_output(scheduler_output,
                                                                   model_runner_output)

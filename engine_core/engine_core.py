"""The engine's step logic without any transport: the one seam for tests, offline use and replay."""
from __future__ import annotations

from collections import deque
from typing import Protocol

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request, RequestStatus
from engine_core.sched.scheduler import Scheduler
from engine_core.structured_output.grammar_limits import GrammarLimits
from engine_core.structured_output.structured_output_manager import StructuredOutputManager
from protocol.engine_config import EngineConfig
from protocol.engine_messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    EngineCoreOutput,
    GrammarsCompiled,
)
from protocol.kv_events import KVEvent
from protocol.lora import AddLoRA, RemoveLoRA
from protocol.model_runner_output import ModelRunnerOutput
from protocol.pooler_config import PoolerConfig
from protocol.scheduler_output import SchedulerOutput


class ModelExecutor(Protocol):
    """Runs one step on the workers and returns rank 0's answer."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class PipelinedExecutor(ModelExecutor, Protocol):
    """Also takes a step without waiting for it; answers come back in submission order."""

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput: ...


class EngineCore:
    """Adds and aborts requests and runs steps: schedule, execute, update.

    Everything that changes what the scheduler decides arrives through `handle` (requests,
    aborts, and the engine's own `GrammarsCompiled`, which the process loop journals), so a
    replay that feeds the same messages at the same steps decides alike.
    """

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor,
                 max_logprobs: int = 20,
                 structured_output: StructuredOutputManager | None = None,
                 pooler_config: PoolerConfig | None = None) -> None:
        self.scheduler = scheduler
        # A pooling engine (--runner pooling) takes only pooling requests, a generating one
        # only the others.
        self.pooler_config = pooler_config
        self.executor = executor
        self.max_logprobs = max_logprobs
        self.structured_output = structured_output or StructuredOutputManager()
        self.batch_queue: deque[SchedulerOutput] = deque()  # submitted, not yet collected
        # Two at most: the scheduler reuses a finished request's handle on the assumption
        # that at most one step is in flight while it schedules (see Scheduler.schedule).
        self.batch_queue_size = 2 if scheduler.async_scheduling else 1

    @staticmethod
    def from_config(config: EngineConfig, executor: ModelExecutor | None, num_blocks: int,
                    max_model_len: int, vocab_size: int | None,
                    sliding_windows: tuple[int, ...] = ()) -> EngineCore:
        """The engine core for `config` once the workers reported their capacity (also what a
        scheduler-only replay builds, so both decide alike)."""
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.token_budget(max_model_len),
                            max_model_len=max_model_len, policy=config.policy,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            async_scheduling=config.async_scheduling,
                            speculative_config=config.speculative_config,
                            max_loras=config.max_loras if config.enable_lora else None),
            CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching,
                        tuple(sliding_windows) or (0,)),
            vocab_size)
        structured_output = StructuredOutputManager(
            config.model, vocab_size, config.structured_outputs_compile_timeout_s,
            GrammarLimits.of(config), config.structured_outputs_mask_wait_ms / 1000)
        if config.runner == "auto" or config.runner == "pooling" and not config.pooler_config:
            config = config.with_runner()  # resolved by the front-end as a rule
        return EngineCore(scheduler, executor, config.max_logprobs, structured_output,
                          config.pooler_config)

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
                          message.arrival_time, message.priority, message.eos_token_id,
                          lora_request=message.lora_request,
                          pooling_params=message.pooling_params)
        try:
            self._check_runner(request)
            if request.lora_request is not None and self.scheduler.lora_slots.max_loras is None:
                raise ValueError(f"request {message.request_id!r} names LoRA adapter "
                                 f"{request.lora_request.lora_name!r}, but LoRA is not enabled "
                                 "(--enable-lora)")
            logprobs = message.sampling_params.logprobs
            if logprobs is not None and logprobs > self.max_logprobs:
                raise ValueError(f"logprobs must be at most {self.max_logprobs} (the engine's "
                                 f"max_logprobs), got {logprobs}")
            self.scheduler.add_request(request)
        except ValueError as e:
            return [EngineCoreOutput(message.request_id, [], "error", error=str(e))]
        self.structured_output.add_request(request)  # a constrained request waits for it
        return []

    def _check_runner(self, request: Request) -> None:
        pooling = request.pooling_params
        if self.pooler_config is None:
            if pooling is not None:
                raise ValueError("a pooling request to a generating model: the engine runs "
                                 "with --runner generate (start it with --runner pooling)")
            return
        if pooling is None:
            raise ValueError("a generation request to a pooling model: the engine runs with "
                             "--runner pooling, which generates no text")
        request.reads_prefix_cache = not (pooling.per_token
                                          or self.pooler_config.needs_every_position)

    def abort_requests(self, message: AbortRequests) -> list[EngineCoreOutput]:
        return self.scheduler.finish_requests(message.request_ids)

    def apply_grammars(self, message: GrammarsCompiled) -> list[EngineCoreOutput]:
        """Ready grammars let their requests be scheduled; failed ones (at compile time or
        computing a mask) finish them; a late mask holds its request until it caught up."""
        outputs: list[EngineCoreOutput] = []
        requests, scheduler = self.scheduler.requests, self.scheduler
        for request_id in message.ready:
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_GRAMMAR:
                continue
            try:
                request.structured_output = self.structured_output.matcher_for(request)
            except ValueError as e:
                outputs += self.fail_requests([request_id], str(e))
                continue
            scheduler.unblock_request(request)
        for failure in message.failed:
            outputs += self.fail_requests([failure.request_id], failure.message)
        for request_id in message.late:
            if request_id in requests:
                scheduler.hold(requests[request_id])
        for request_id in message.caught_up:
            if request_id in requests:
                scheduler.release(requests[request_id])
        return outputs

    def fail_requests(self, request_ids: list[str], error: str) -> list[EngineCoreOutput]:
        """Finish unfinished requests with finish reason "error" and `error` as the reason
        (a constrained one's grammar is then cached as failed with it)."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.structured_output.fail(request, error)
        outputs = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        for out in outputs:
            out.error = error
        return outputs

    def handle(self, message: AddRequest | AddRequests | AbortRequests | GrammarsCompiled
               | AddLoRA | RemoveLoRA) -> list[EngineCoreOutput]:
        """Apply a front-end message (an adapter's registration changes nothing here: the
        process forwards it to the workers, and requests carry their adapter)."""
        if isinstance(message, (AddLoRA, RemoveLoRA)):
            return []
        if isinstance(message, AddRequest):
            return self.add_request(message)
        if isinstance(message, AddRequests):
            return [out for request in message.requests for out in self.add_request(request)]
        if isinstance(message, GrammarsCompiled):
            return self.apply_grammars(message)
        return self.abort_requests(message)

    def poll_grammars(self) -> GrammarsCompiled | None:
        """What the process loop journals and then `handle`s: grammars that finished (or
        failed) compiling since the last call."""
        return self.structured_output.poll()

    def has_work(self) -> bool:
        """Requests that can run, or steps in flight (requests waiting for their grammars
        or masks are no work until `GrammarsCompiled` says so). Handles that finished since the last
        step are announced in the next real step, never in an empty one whose timing would
        depend on the clock."""
        return self.scheduler.has_runnable_requests() or bool(self.batch_queue)

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the masks of its constrained requests (their
        proposals first cut to what their grammars accept)."""
        self.structured_output.cut_drafts(self.scheduler.speculator.cut)
        return self.structured_output.attach_bitmask(self.scheduler.schedule(),
                                                     self.scheduler.requests_by_handle,
                                                     self.scheduler.handles.bound)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's answer: tokens, stops, and the constrained requests' matchers."""
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        refused = self.structured_output.accept_tokens(scheduler_output, model_runner_output)
        for request, error in refused:
            outputs += self.fail_requests([request.request_id], error)
        return outputs

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """One synchronous step (schedule, execute, update) and the step message it ran: the
        seam unit tests, tools and benchmarks drive (vLLM's `EngineCore.step`). The process
        loop calls `step_with_batch_queue`, which with a queue of one does the same."""
        scheduler_output = self.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        return scheduler_output, self.update_from_output(scheduler_output, model_runner_output)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """One call of the step loop: schedule and submit the next step if there is work and
        room in the queue, then collect the oldest step once the queue is full (or nothing
        else can be scheduled). With a queue of one this is `step()`; with two (async
        scheduling) the workers run step N+1 while step N's answer is applied, except while
        a constrained request has a token in flight: its next mask depends on that token,
        so step N is collected first, and this call ends there (the loop then polls grammar
        work: the masks it started are ready, or late, before the next step is scheduled)."""
        if self.batch_queue and self.structured_output.waits_for_tokens():
            return self._collect_oldest()
        if self.scheduler.has_runnable_requests() and len(self.batch_queue) < \
                self.batch_queue_size:
            scheduler_output = self.schedule()
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
        return self.update_from_output(self.batch_queue.popleft(), executor.collect())

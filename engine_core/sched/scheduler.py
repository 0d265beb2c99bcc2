"""The scheduler: one token budget per step, running requests first, then waiting ones."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.admission import Admission
from engine_core.sched.audit import audit_scheduler
from engine_core.sched.handle_allocator import HandleAllocator
from engine_core.sched.lora_slots import LoRASlots
from engine_core.sched.output_update import OutputUpdate
from engine_core.sched.preemption import Preemption
from engine_core.sched.request_queue import create_request_queue
from engine_core.sched.request_table import RequestTable
from engine_core.sched.running_pass import RunningPass
from engine_core.sched.step_plan import StepPlan
from engine_core.spec_decode.speculator import make_speculator
from protocol.engine_messages import EngineCoreOutput, SchedulerStats
from protocol.prompt_check import check_prompt
from protocol.scheduler_output import MAX_NEW_PROMPT_TOKENS, SchedulerOutput

_QUEUED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)


class Scheduler(RunningPass, Admission, Preemption, OutputUpdate):
    """Decides each step which tokens of which requests run, in vLLM v1's model.

    There are no prefill or decode phases: every request has `num_computed_tokens` catching up
    with `num_tokens`, and a step hands out at most `max_num_batched_tokens` of the missing
    tokens, serving running requests first (admission order) and then waiting ones. When the
    KV cache runs out, running requests are preempted by recompute; no waiting request is
    admitted in a step that preempted. All containers iterated here are ordered, so the same
    inputs always give the same step messages.

    Its parts, one concern each, are mixins over this state: `RunningPass` (running requests),
    `Admission` (waiting ones), `Preemption`, `OutputUpdate` (`update_from_output`).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 vocab_size: int | None = None) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before building a Scheduler")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        if self.max_model_len > MAX_NEW_PROMPT_TOKENS:
            raise ValueError(f"max_model_len={self.max_model_len} is more than one step "
                             f"message can carry ({MAX_NEW_PROMPT_TOKENS} prompt tokens)")
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size  # when known, prompts with ids beyond it are refused
        lookahead = (scheduler_config.speculative_config.num_speculative_tokens
                     if scheduler_config.speculative_config is not None else 0)
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            cache_config.sliding_windows, scheduler_config.max_num_batched_tokens + lookahead)
        # The longest sequence whose KV the whole cache holds (per layer group, as its
        # window allows); one token more can still be sampled after it.
        self.max_kv_tokens = self.kv_cache_manager.max_sequence_tokens(self.max_model_len)
        self.max_seq_len = min(self.max_model_len, self.max_kv_tokens + 1)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: list[int] = []  # handles to announce in the next step
        self.handles = HandleAllocator()
        self.requests_by_handle: dict[int, Request] = {}
        # Counters of requests with a handle.
        self.table = RequestTable(speculative=scheduler_config.speculative_config is not None)
        self._handles_of_running: np.ndarray | None = None  # cache of _running_handles()
        self.step = 0
        self.num_preemptions = 0
        self.async_scheduling = scheduler_config.async_scheduling
        self.speculator = make_speculator(scheduler_config.speculative_config, self.table,
                                          self.requests_by_handle)
        self.num_lookahead_tokens = self.speculator.num_lookahead_tokens
        self.num_blocked = 0  # waiting requests whose grammars are not ready
        self.num_held = 0  # requests (running or preempted) whose next mask is not ready
        self.lora_slots = LoRASlots(scheduler_config.max_loras)

    # --- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (changing nothing) if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_prompt(request.prompt_token_ids, self.max_model_len,
                     self.kv_cache_manager.num_usable_blocks, self.block_size, self.vocab_size,
                     self.max_kv_tokens if len(self.kv_cache_manager.groups) > 1 else 0,
                     needs_output=request.pooling_params is None)
        if request.status not in _QUEUED or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled")
        request.length_end = min(request.length_end, self.max_seq_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self.num_blocked += request.status == RequestStatus.WAITING_FOR_GRAMMAR

    def unblock_request(self, request: Request) -> None:
        """A request waiting for its grammar may be scheduled from now on, in its place."""
        if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            request.status = RequestStatus.WAITING
            self.num_blocked -= 1

    def hold(self, request: Request) -> None:
        """The request's next mask is not ready: it takes no tokens (and is not resumed
        after a preemption) until `release`."""
        if not request.mask_late and not request.is_finished():
            request.mask_late = True
            self._set_held(request, 1)

    def release(self, request: Request) -> None:
        """A held request's mask is ready: it is scheduled again, in its place."""
        if request.mask_late:
            request.mask_late = False
            self._set_held(request, -1)

    def _set_held(self, request: Request, change: int) -> None:
        self.num_held += change
        self.table.any_held += change
        if request.req_id >= 0:
            self.table.held[request.req_id] = change > 0

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        ) -> list[EngineCoreOutput]:
        """Finish unfinished requests from outside (abort by default); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs, stopped = [], []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                stopped.append(request)
            else:
                self.waiting.remove(request)
                self.num_blocked -= request.status == RequestStatus.WAITING_FOR_GRAMMAR
            request.status = status
            outputs.append(EngineCoreOutput(request_id, [], FINISH_REASONS[status],
                                            num_cached_tokens=max(request.num_cached_tokens, 0)))
            self._free_request(request)
        if stopped:
            self.running = [r for r in self.running if not r.is_finished()]
            self._handles_of_running = None
        return outputs

    def _free_request(self, request: Request) -> None:
        self.release(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.req_id >= 0:
            self.finished_req_ids.append(request.req_id)
            del self.requests_by_handle[request.req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_runnable_requests(self) -> bool:
        """Unfinished requests other than those waiting for their grammars or masks."""
        return len(self.running) + len(self.waiting) > self.num_blocked + self.num_held

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        plan = StepPlan(self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        finished, self.finished_req_ids = self.finished_req_ids, []
        output = plan.build(self.step, finished, self.kv_cache_manager, self.table,
                            self.handles.bound, self.max_model_len,
                            *self.speculator.schedule(plan))
        self._update_after_schedule(plan)
        # Reusable from the next step on. Under async scheduling at most one step is in flight
        # while this one is scheduled, and it is collected before the next is scheduled, so
        # no late answer can reach a request that took over one of these handles.
        self.handles.release(finished)
        return output

    def _update_after_schedule(self, plan: StepPlan) -> None:
        """Advance each scheduled request's `num_computed_tokens` by its tokens; under async
        scheduling, count the token a request that reaches its end will sample."""
        requests, handles, counts = plan.scheduled()
        computed, pending = self.table.advance(handles, counts, self.async_scheduling)
        for request, num_computed in zip(requests, computed):
            request.num_computed_tokens = num_computed
        if pending is not None:
            for request, num_pending in zip(requests, pending):
                request.num_output_placeholders = num_pending

    # --- inspection ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Audit scheduler state and the block pool; raises IntegrityError on inconsistency."""
        audit_scheduler(self)

    def get_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(len(self.running), len(self.waiting),
                              pool.num_blocks - 1 - pool.get_num_free_blocks(),
                              pool.num_blocks - 1, self.num_preemptions,
                              self.speculator.stats())

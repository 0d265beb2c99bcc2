"""The scheduler: one token budget per step, running requests first, then waiting ones."""
from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.audit import audit_scheduler
from engine_core.sched.handle_allocator import HandleAllocator
from engine_core.sched.lora_slots import LoRASlots
from engine_core.sched.request_queue import create_request_queue
from engine_core.sched.request_table import RequestTable, answer_rows
from engine_core.sched.step_plan import StepPlan
from engine_core.sched.stop_check import append_tokens, check_stop
from engine_core.spec_decode.speculator import make_speculator
from protocol.engine_messages import EngineCoreOutput, SchedulerStats
from protocol.model_runner_output import ModelRunnerOutput
from protocol.prompt_check import check_prompt
from protocol.scheduler_output import MAX_NEW_PROMPT_TOKENS, SchedulerOutput

_QUEUED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)


class Scheduler:
    """Decides each step which tokens of which requests run, in vLLM v1's model.

    There are no prefill or decode phases: every request has `num_computed_tokens` catching up
    with `num_tokens`, and a step hands out at most `max_num_batched_tokens` of the missing
    tokens, serving running requests first (admission order) and then waiting ones. When the
    KV cache runs out, running requests are preempted by recompute; no waiting request is
    admitted in a step that preempted. All containers iterated here are ordered, so the same
    inputs always give the same step messages.
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

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests and report what changed."""
        outputs: list[EngineCoreOutput] = []
        logprobs = model_runner_output.logprobs
        by_handle = self.requests_by_handle
        irregular: list[int] = []  # entries that did not append exactly one token
        stopped: list[tuple[Request, bool]] = []  # (request, was waiting), in output order
        for i, (req_id, token_ids) in enumerate(zip(model_runner_output.req_ids,
                                                    model_runner_output.sampled_token_ids)):
            request = by_handle.get(req_id)
            if request is None or len(token_ids) != 1:
                irregular.append(i)
                if request is None or not token_ids:
                    continue  # aborted meanwhile, or a prefill chunk short of the prompt's end
            # A request preempted after this step was scheduled still takes its token: the
            # workers appended it too. One token (the hot path) is `append_tokens` inlined.
            if len(token_ids) == 1:
                token = token_ids[0]
                request.output_token_ids.append(token)
                request.all_token_ids.append(token)
                if request.num_output_placeholders:  # 0 if preempted since: the count restarted
                    request.num_output_placeholders -= 1
                reason = None
                if token in request.stop_tokens or len(request.all_token_ids) >= request.length_end:
                    reason = self._check_stop(request, token, stopped)
            else:
                token_ids, reason = self._append_tokens(request, token_ids, stopped)
            outputs.append(EngineCoreOutput(request.request_id, token_ids, reason,
                                            request.stop_reason,
                                            logprobs[i][:len(token_ids)]
                                            if logprobs and logprobs[i] else None,
                                            request.num_cached_tokens,
                                            scheduled_time=request.scheduled_time
                                            if request.num_output_tokens == len(token_ids) else None))
        self.table.record_sampled(answer_rows(scheduler_output, model_runner_output, irregular))
        if model_runner_output.pooler_output:
            outputs += self._finish_pooled(model_runner_output, stopped)
        if stopped:
            self._finish_stopped(stopped)
        self.speculator.update(scheduler_output, model_runner_output)
        return outputs

    # --- scheduling helpers ----------------------------------------------------------------

    def _schedule_running(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            i = self._schedule_running_from(plan, i)

    def _schedule_running_from(self, plan: StepPlan, start: int) -> int:
        """Running requests from index `start` on, in one vectorized pass; only those whose
        step needs the KV cache manager (a new block, a full block to publish) are visited
        one by one. If the cache runs out, victims are preempted and the index to go on
        from is returned (the end of `running` when the pass completed)."""
        running, kv = self.running, self.kv_cache_manager
        handles = self._running_handles()[start:]
        take, needs_kv = self.table.schedule_pass(handles, plan.budget, self.max_model_len,
                                                  self.long_prefill_token_threshold,
                                                  self.num_lookahead_tokens)
        new_block_ids: dict[int, list[int]] = {}
        for i in np.flatnonzero(needs_kv).tolist():
            request, n = running[start + i], int(take[i])
            lookahead = self._lookahead(request, n) if self.num_lookahead_tokens else 0
            block_ids = kv.allocate_slots(request, n, num_lookahead_tokens=lookahead)
            if block_ids is None:
                plan.add_running_pass(handles[:i], take[:i], running, start, new_block_ids)
                block_ids = self._preempt_until_fits(request, n, plan)
                if block_ids is None:
                    return len(running)  # it preempted itself: nothing after it can run
                self.table.sync_blocks(request, kv)
                plan.add_running(request, n, block_ids or None)
                return running.index(request) + 1  # victims may have stood before it
            self.table.sync_blocks(request, kv)
            if block_ids:
                new_block_ids[i] = block_ids
        plan.add_running_pass(handles, take, running, start, new_block_ids)
        return len(running)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in the queue's order; those waiting for their grammars
        or masks are passed over and keep their places."""
        skipped: list[Request] = []
        try:
            self._admit_waiting(plan, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend(request)

    def _admit_waiting(self, plan: StepPlan, skipped: list[Request]) -> None:
        kv = self.kv_cache_manager
        self.lora_slots.begin(self.running)
        while (len(self.waiting) and plan.budget > 0
               and len(self.running) < self.scheduler_config.max_num_seqs):
            request = self.waiting.peek()
            if (request.status == RequestStatus.WAITING_FOR_GRAMMAR or request.mask_late
                    or not self.lora_slots.admits(request)):
                skipped.append(self.waiting.pop())
                continue
            if plan.new and plan.new_prompt_tokens + request.num_tokens > MAX_NEW_PROMPT_TOKENS:
                break  # the step message carries every new prompt in full
            hits, num_hit = kv.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if 0 < self.long_prefill_token_threshold < n:
                n = self.long_prefill_token_threshold
            if not self.scheduler_config.enable_chunked_prefill and n > plan.budget:
                break  # no skipping ahead to a shorter prompt
            n = min(n, plan.budget)
            new_block_ids = kv.allocate_slots(request, n, num_hit, hits,
                                              full_sequence_must_fit=True)
            if new_block_ids is None:
                break  # head-of-line blocking keeps the policy's order
            self.waiting.pop()
            resumed = request.status == RequestStatus.PREEMPTED
            self._admit(request, num_hit)
            self.lora_slots.add(request)
            if resumed:
                plan.add_resumed(request, n, kv.get_block_ids(request.request_id))
            else:
                plan.add_new(request, n)

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

    def _preempt_until_fits(self, request: Request, n: int, plan: StepPlan) -> list[int] | None:
        """Preempt victims until the request's slots fit; None if it became the victim."""
        while True:
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, n, num_lookahead_tokens=self._lookahead(request, n))
            if new_block_ids is not None:
                return new_block_ids

    def _lookahead(self, request: Request, n: int) -> int:
        """Slots past the step's n tokens a draft model writes into (not past max_model_len)."""
        return min(self.num_lookahead_tokens,
                   self.max_model_len - request.num_computed_tokens - n)

    def _pick_victim(self) -> Request:
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Recompute preemption: drop the KV, rewind, and queue at the front."""
        self.running.remove(victim)
        self._handles_of_running = None
        plan.drop(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0
        victim.spec_token_ids = []
        self.table.preempt(victim, self.kv_cache_manager)
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        plan.preempted.append(victim.req_id)

    def _admit(self, request: Request, num_computed_tokens: int) -> None:
        if request.req_id < 0:
            request.req_id = self.handles.allocate()
            self.requests_by_handle[request.req_id] = request
        if request.num_cached_tokens < 0:  # first scheduled
            request.num_cached_tokens = num_computed_tokens
            request.scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        self.table.admit(request, self.kv_cache_manager)
        self.running.append(request)
        self._handles_of_running = None

    def _running_handles(self) -> np.ndarray:
        """The handles of `running`, in order (rebuilt after the list changes)."""
        if self._handles_of_running is None:
            self._handles_of_running = np.fromiter((r.req_id for r in self.running), np.int64,
                                                   len(self.running))
        return self._handles_of_running

    # --- update helpers ---------------------------------------------------------------------

    def _check_stop(self, request: Request, token_id: int,
                    stopped: list[tuple[Request, bool]]) -> str | None:
        """After appending `token_id`: if it ends the request, list it in `stopped` (with
        whether it was waiting) and return the finish reason."""
        was_waiting = request.status == RequestStatus.PREEMPTED
        if not check_stop(request, token_id, self.max_seq_len):
            return None
        stopped.append((request, was_waiting))
        return FINISH_REASONS[request.status]

    def _append_tokens(self, request: Request, token_ids: list[int],
                       stopped: list[tuple[Request, bool]]) -> tuple[list[int], str | None]:
        """`append_tokens` (several tokens: the general path), with the table following."""
        was_waiting = request.status == RequestStatus.PREEMPTED
        token_ids = append_tokens(request, token_ids, self.max_seq_len)
        self.table.num_tokens[request.req_id] = request.num_tokens
        self.table.placeholders[request.req_id] = request.num_output_placeholders
        if not request.is_finished():
            return token_ids, None
        stopped.append((request, was_waiting))
        return token_ids, FINISH_REASONS[request.status]

    def _finish_pooled(self, model_runner_output: ModelRunnerOutput,
                       stopped: list[tuple[Request, bool]]) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt has run: each finishes ("stop") with its result."""
        outputs = []
        for req_id, data in zip(model_runner_output.req_ids, model_runner_output.pooler_output):
            request = self.requests_by_handle.get(req_id)
            if data is None or request is None or request.pooling_params is None:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            stopped.append((request, False))
            outputs.append(EngineCoreOutput(request.request_id, [], "stop",
                                            num_cached_tokens=request.num_cached_tokens,
                                            scheduled_time=request.scheduled_time,
                                            pooling_output=data))
        return outputs

    def _finish_stopped(self, stopped: list[tuple[Request, bool]]) -> None:
        for request, was_waiting in stopped:
            if was_waiting:
                self.waiting.remove(request)
            self._free_request(request)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        self._handles_of_running = None

    def _free_request(self, request: Request) -> None:
        self.release(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.req_id >= 0:
            self.finished_req_ids.append(request.req_id)
            del self.requests_by_handle[request.req_id]

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

"""The scheduler: one token budget per step, running requests first, then waiting ones."""
from __future__ import annotations

import time
from collections.abc import Iterable

from engine_core.block_pool import IntegrityError
from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.handle_allocator import HandleAllocator
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.request_queue import create_request_queue
from engine_core.step_plan import StepPlan
from engine_core.stop_check import check_stop
from protocol.engine_messages import EngineCoreOutput, SchedulerStats
from protocol.model_runner_output import ModelRunnerOutput
from protocol.prompt_check import check_prompt
from protocol.scheduler_output import SchedulerOutput


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
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size  # when known, prompts with ids beyond it are refused
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        # A sequence longer than this cannot be computed even with the whole cache.
        self.max_seq_len = min(self.max_model_len,
                               self.kv_cache_manager.num_usable_blocks * self.block_size + 1)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: list[int] = []  # handles to announce in the next step
        self.handles = HandleAllocator()
        self.requests_by_handle: dict[int, Request] = {}
        self.step = 0
        self.num_preemptions = 0
        self.async_scheduling = scheduler_config.async_scheduling

    # --- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (changing nothing) if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_prompt(request.prompt_token_ids, self.max_model_len,
                     self.kv_cache_manager.num_usable_blocks, self.block_size, self.vocab_size)
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled")
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
            request.status = status
            outputs.append(EngineCoreOutput(request_id, [], request.get_finished_reason(),
                                            num_cached_tokens=max(request.num_cached_tokens, 0)))
            self._free_request(request)
        if stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

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
        output = plan.build(self.step, finished, self.kv_cache_manager, self.handles.bound,
                            self.max_model_len, self.async_scheduling)
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
        by_handle, finished = self.requests_by_handle, False
        for i, (req_id, token_ids) in enumerate(zip(model_runner_output.req_ids,
                                                    model_runner_output.sampled_token_ids)):
            request = by_handle.get(req_id)
            if not token_ids or request is None:
                continue  # a prefill chunk short of the prompt's end, or aborted meanwhile
            # A request preempted after this step was scheduled still takes its token: the
            # workers appended it too.
            was_waiting = request.status == RequestStatus.PREEMPTED
            if request.num_output_placeholders:  # 0 if preempted since: the count restarted
                request.num_output_placeholders -= 1
            new_token_ids = self._append_tokens(request, token_ids)
            reason = FINISH_REASONS.get(request.status)
            outputs.append(EngineCoreOutput(request.request_id, new_token_ids, reason,
                                            request.stop_reason,
                                            logprobs[i] if logprobs else None,
                                            request.num_cached_tokens,
                                            scheduled_time=request.scheduled_time
                                            if request.num_output_tokens == len(new_token_ids)
                                            else None))
            if reason is not None:
                if was_waiting:
                    self.waiting.remove(request)
                self._free_request(request)
                finished = True
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    # --- scheduling helpers ----------------------------------------------------------------

    def _schedule_running(self, plan: StepPlan) -> None:
        running, kv = self.running, self.kv_cache_manager
        i = 0
        while i < len(running) and plan.budget > 0:
            request = running[i]
            n = self._num_new_tokens(request, plan.budget)
            if n <= 0:
                i += 1  # nothing to do now; others still get their turn
                continue
            new_block_ids = kv.allocate_slots(request, n)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_fits(request, n, plan)
                if new_block_ids is None:
                    break  # it preempted itself: nothing after it can be served either
                i = running.index(request)  # victims may have stood before it
            plan.running[request.req_id] = (request, n, new_block_ids or None)
            plan.budget -= n
            i += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        while (len(self.waiting) and plan.budget > 0
               and len(self.running) < self.scheduler_config.max_num_seqs):
            request = self.waiting.peek()
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
            if resumed:
                plan.add_resumed(request, n, kv.get_block_ids(request.request_id))
            else:
                plan.add_new(request, n)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        computed, pending = request.num_computed_tokens, request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.max_seq_len):
            return 0  # the tokens in flight already end it by length
        n = len(request.all_token_ids) + pending - computed
        if 0 < self.long_prefill_token_threshold < n:
            n = self.long_prefill_token_threshold
        # Positions computed this step must stay below max_model_len.
        return min(n, budget, self.max_model_len - 1 - computed)

    def _preempt_until_fits(self, request: Request, n: int, plan: StepPlan) -> list[int] | None:
        """Preempt victims until the request's slots fit; None if it became the victim."""
        while True:
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, n)
            if new_block_ids is not None:
                return new_block_ids

    def _pick_victim(self) -> Request:
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Recompute preemption: drop the KV, rewind, and queue at the front."""
        self.running.remove(victim)
        plan.drop(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0
        victim.num_preemptions += 1
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
        self.running.append(request)

    # --- update helpers ---------------------------------------------------------------------

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append tokens up to and including the first that stops the request."""
        for k, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            if check_stop(request, token_id, self.max_seq_len):
                return token_ids[:k + 1]
        return token_ids

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.req_id >= 0:
            self.finished_req_ids.append(request.req_id)
            del self.requests_by_handle[request.req_id]

    # --- inspection ---------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(len(self.running), len(self.waiting),
                              pool.num_blocks - 1 - pool.get_num_free_blocks(),
                              pool.num_blocks - 1, self.num_preemptions)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Audit scheduler state and the block pool; raises IntegrityError on inconsistency."""
        queued = list(self.waiting)
        if any(r.status != RequestStatus.RUNNING for r in self.running) or any(
                r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in queued):
            raise IntegrityError("a queued request has the wrong status")
        ids = [r.request_id for r in self.running + queued]
        if sorted(ids) != sorted(self.requests):
            raise IntegrityError("running + waiting do not match the known requests")
        if any(r.num_computed_tokens > r.num_tokens + r.num_output_placeholders
               for r in self.running):
            raise IntegrityError("a request computed more tokens than it has")
        self.kv_cache_manager.check_integrity()

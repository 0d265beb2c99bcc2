"""Admitting waiting requests, a part of `Scheduler`: after the running requests, the step's
remaining budget goes to waiting ones (new or preempted) in the queue's order, each with
its prefix-cache hits, while the KV cache, the step message and the LoRA slots allow."""
from __future__ import annotations

import time

import numpy as np

from engine_core.config import SchedulerConfig
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.sched.handle_allocator import HandleAllocator
from engine_core.sched.lora_slots import LoRASlots
from engine_core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue
from engine_core.sched.request_table import RequestTable
from engine_core.sched.step_plan import StepPlan
from protocol.scheduler_output import MAX_NEW_PROMPT_TOKENS


class Admission:
    """Waiting requests into `running` (a `Scheduler` mixin: the state is the scheduler's)."""

    scheduler_config: SchedulerConfig
    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    table: RequestTable
    kv_cache_manager: KVCacheManager
    handles: HandleAllocator
    requests_by_handle: dict[int, Request]
    lora_slots: LoRASlots
    long_prefill_token_threshold: int
    _handles_of_running: np.ndarray | None

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

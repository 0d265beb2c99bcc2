"""Scheduling running requests, a part of `Scheduler`: each step serves the running requests
first, in admission order, in vectorized passes over the request table; a request that
needs a new block goes through the KV cache manager, and preemption where it runs out."""
from __future__ import annotations

import numpy as np

from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.sched.request_table import RequestTable
from engine_core.sched.step_plan import StepPlan


class RunningPass:
    """The running requests' share of a step (a `Scheduler` mixin: the state is the
    scheduler's)."""

    running: list[Request]
    table: RequestTable
    kv_cache_manager: KVCacheManager
    max_model_len: int
    long_prefill_token_threshold: int
    num_lookahead_tokens: int
    _handles_of_running: np.ndarray | None

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

    def _lookahead(self, request: Request, n: int) -> int:
        """Slots past the step's n tokens a draft model writes into (not past max_model_len)."""
        return min(self.num_lookahead_tokens,
                   self.max_model_len - request.num_computed_tokens - n)

    def _running_handles(self) -> np.ndarray:
        """The handles of `running`, in order (rebuilt after the list changes)."""
        if self._handles_of_running is None:
            self._handles_of_running = np.fromiter((r.req_id for r in self.running), np.int64,
                                                   len(self.running))
        return self._handles_of_running

"""Recompute preemption, a part of `Scheduler`: when the KV cache runs out, running requests
give up their blocks and queue again at the front, to recompute their tokens later."""
from __future__ import annotations

import numpy as np

from engine_core.config import SchedulerConfig
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue
from engine_core.sched.request_table import RequestTable
from engine_core.sched.step_plan import StepPlan


class Preemption:
    """Victims for a request whose slots do not fit (a `Scheduler` mixin: the state is the
    scheduler's)."""

    scheduler_config: SchedulerConfig
    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    table: RequestTable
    kv_cache_manager: KVCacheManager
    num_preemptions: int
    _handles_of_running: np.ndarray | None

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

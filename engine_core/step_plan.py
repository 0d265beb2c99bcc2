"""The decisions of one `schedule()` call, turned into a `SchedulerOutput` at the end."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from protocol.int_column import IntColumn
from protocol.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """Requests scheduled so far in this step, in scheduling order, keyed by handle.

    `running` holds requests the workers know (running ones, then ones resumed after
    preemption); `new` holds first-time requests. Values are `(request, num_tokens,
    new_block_ids)`; for resumed requests `new_block_ids` is the whole replacement list.
    """

    budget: int
    running: dict[int, tuple[Request, int, list[int] | None]] = field(default_factory=dict)
    new: dict[int, tuple[Request, int]] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    def add_resumed(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.running[request.req_id] = (request, num_tokens, block_ids)
        self.resumed.append(request.req_id)
        self.budget -= num_tokens

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new[request.req_id] = (request, num_tokens)
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo a running request scheduled earlier in this step (it was just preempted).
        Only running requests are preempted, and before any waiting one is admitted."""
        entry = self.running.pop(request.req_id, None)
        if entry is not None:
            self.budget += entry[1]

    def build(self, step: int, finished_req_ids: list[int], kv_cache_manager: KVCacheManager,
              max_handle: int, max_model_len: int) -> SchedulerOutput:
        """The step message; `num_computed_tokens` are the counts before this step's tokens."""
        new_reqs, counts = [], []
        for request, n in self.new.values():
            new_reqs.append(NewRequestData(
                request.req_id, request.request_id, request.prompt_token_ids,
                request.sampling_params, kv_cache_manager.get_block_ids(request.request_id),
                request.num_computed_tokens, request.eos_token_id))
            counts.append(n)
        req_ids, num_computed, new_block_ids = [], [], []
        for req_id, (request, n, block_ids) in self.running.items():
            req_ids.append(req_id)
            num_computed.append(request.num_computed_tokens)
            new_block_ids.append(block_ids)
            counts.append(n)
        cached = CachedRequestData(IntColumn.for_bound(req_ids, max_handle),
                                   IntColumn.for_bound(num_computed, max_model_len),
                                   new_block_ids, self.resumed)
        return SchedulerOutput(new_reqs, cached, IntColumn.narrowest(counts), sum(counts),
                               finished_req_ids, self.preempted, step)

    def scheduled(self):
        """(request, num_tokens) of every scheduled request, in step order."""
        for request, n in self.new.values():
            yield request, n
        for request, n, _ in self.running.values():
            yield request, n

"""The decisions of one `schedule()` call, turned into a `SchedulerOutput` at the end."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.sched.request_table import RequestTable
from protocol.draft_tokens import DraftTokens
from protocol.int_column import IntColumn
from protocol.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    ScheduledTokens,
    SchedulerOutput,
    SpecDecodeSchedulerOutput,
)


@dataclass(slots=True)
class StepPlan:
    """Requests scheduled so far in this step, in scheduling order.

    `new` holds first-time requests as `(request, num_tokens)`. Requests the workers know
    (running ones, then ones resumed after preemption) are parallel columns: request
    `requests[i]`, handle `req_ids[i]`, takes `counts[i]` tokens and gets `new_block_ids[i]`
    (None: no new blocks; for resumed requests, whose handles are in `resumed`, the whole
    replacement list). `req_ids` and `counts` are int64 arrays.
    """

    budget: int
    new: list[tuple[Request, int]] = field(default_factory=list)
    req_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    requests: list[Request] = field(default_factory=list)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    new_prompt_tokens: int = 0  # prompt tokens of `new`, all sent in this step's message

    def add_running(self, request: Request, num_tokens: int,
                    new_block_ids: list[int] | None) -> None:
        self.extend_running(np.array([request.req_id], np.int64), [request],
                            np.array([num_tokens], np.int64), [new_block_ids])

    def extend_running(self, req_ids: np.ndarray, requests: list[Request], counts: np.ndarray,
                       new_block_ids: list[list[int] | None]) -> None:
        self.budget -= int(counts.sum())
        if self.requests:
            req_ids = np.concatenate((self.req_ids, req_ids))
            counts = np.concatenate((self.counts, counts))
        self.req_ids, self.counts = req_ids, counts
        self.requests += requests
        self.new_block_ids += new_block_ids

    def add_running_pass(self, handles: np.ndarray, take: np.ndarray, running: list[Request],
                         start: int, new_block_ids: dict[int, list[int]]) -> None:
        """From one pass over the running requests from index `start` on: `running[start + i]`
        (handle `handles[i]`) takes `take[i]` tokens, if > 0, and gets `new_block_ids.get(i)`."""
        chosen = np.flatnonzero(take)
        indices = chosen.tolist()
        if start == 0 and len(indices) == len(running):
            requests = running[:]
        else:
            requests = [running[start + i] for i in indices]
        blocks: list[list[int] | None] = [None] * len(indices)
        if new_block_ids:
            position = np.cumsum(take > 0) - 1  # running index -> index among the chosen
            for i, block_ids in new_block_ids.items():
                blocks[position[i]] = block_ids
        self.extend_running(handles[chosen], requests, take[chosen], blocks)

    def add_resumed(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.add_running(request, num_tokens, block_ids)
        self.resumed.append(request.req_id)

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new.append((request, num_tokens))
        self.budget -= num_tokens
        self.new_prompt_tokens += request.num_prompt_tokens

    def drop(self, request: Request) -> None:
        """Undo a running request scheduled earlier in this step (it was just preempted).
        Only running requests are preempted, and before any waiting one is admitted."""
        found = np.flatnonzero(self.req_ids == request.req_id)
        if len(found):
            i = int(found[0])
            self.budget += int(self.counts[i])
            self.req_ids, self.counts = np.delete(self.req_ids, i), np.delete(self.counts, i)
            del self.requests[i], self.new_block_ids[i]

    def scheduled(self) -> tuple[list[Request], np.ndarray, np.ndarray]:
        """Every scheduled request in step order, with its handle and token count."""
        if not self.new:
            return self.requests, self.req_ids, self.counts
        requests = [request for request, _ in self.new] + self.requests
        handles = np.array([request.req_id for request, _ in self.new], np.int64)
        counts = np.array([n for _, n in self.new], np.int64)
        return (requests, np.concatenate((handles, self.req_ids)),
                np.concatenate((counts, self.counts)))

    def build(self, step: int, finished_req_ids: list[int], kv_cache_manager: KVCacheManager,
              table: RequestTable, max_handle: int, max_model_len: int,
              spec_decode_tokens: DraftTokens | None = None,
              num_spec_tokens_to_propose: IntColumn | None = None) -> SchedulerOutput:
        """The step message; `num_computed_tokens` are the counts before this step's tokens.
        With drafts to verify or to propose, a `SpecDecodeSchedulerOutput`."""
        new_reqs = [NewRequestData(
            request.req_id, request.request_id, request.prompt_token_ids,
            request.sampling_params, kv_cache_manager.get_block_ids(request.request_id),
            request.num_computed_tokens, request.eos_token_id, request.lora_request,
            pooling_params=request.pooling_params) for request, _ in self.new]
        handles = self.req_ids
        cached = CachedRequestData(_column(handles, max_handle),
                                   _column(table.num_computed[handles], max_model_len),
                                   self.new_block_ids, self.resumed)
        counts = self.scheduled()[2]
        tokens = ScheduledTokens(_column(counts, int(counts.max(initial=0)) + 1))
        args = (new_reqs, cached, tokens, int(counts.sum()), finished_req_ids, self.preempted,
                step)
        if spec_decode_tokens is None and num_spec_tokens_to_propose is None:
            return SchedulerOutput(*args)
        return SpecDecodeSchedulerOutput(*args, spec_decode_tokens, num_spec_tokens_to_propose)


def _column(values: np.ndarray, bound: int) -> IntColumn:
    typecode = IntColumn.typecode_for(bound)
    return IntColumn.from_native_bytes(typecode, values.astype(typecode).tobytes())

"""The per-step plan the scheduler sends to every worker.

A request is named on this wire by `req_id`, a small integer handle the scheduler assigns when
it first schedules the request and recycles after the workers have been told it finished. The
external string id travels once, in `NewRequestData.request_id`.

Workers cache everything a request needs the first time they see it (`NewRequestData`); after
that only deltas travel (`CachedRequestData`), and the worker appends its own sampled tokens.
"""
from __future__ import annotations

from functools import cached_property

import msgspec

from protocol.int_column import IntColumn
from protocol.sampling_params import SamplingParams
from protocol.wire_struct import WireStruct


class NewRequestData(WireStruct):
    """A request scheduled for the first time: sent once, in full."""

    req_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens whose KV is already in `block_ids` (the prefix-cache hit length).
    num_computed_tokens: int = 0
    eos_token_id: int | None = None


class CachedRequestData(WireStruct):
    """Deltas for requests the workers already know, as parallel columns.

    `num_computed_tokens[i]` is request i's count *before* this step's tokens. Integer
    columns are `IntColumn`s: packed on the wire, they decode without an object per request.
    `new_block_ids[i]` is None when request i got no new blocks; otherwise its new blocks are
    appended to the worker's list, except for requests in `resumed_req_ids` (resumed after
    preemption), whose list is replaced by `new_block_ids[i]`.
    """

    req_ids: IntColumn = msgspec.field(default_factory=IntColumn)
    num_computed_tokens: IntColumn = msgspec.field(default_factory=IntColumn)
    new_block_ids: list[list[int] | None] = []
    resumed_req_ids: list[int] = []

    def __post_init__(self) -> None:
        if not isinstance(self.req_ids, IntColumn):  # a hand-made message
            self.req_ids = IntColumn.narrowest(self.req_ids)
        if not isinstance(self.num_computed_tokens, IntColumn):
            self.num_computed_tokens = IntColumn.narrowest(self.num_computed_tokens)
        if not len(self.req_ids) == len(self.num_computed_tokens) == len(self.new_block_ids):
            raise ValueError("CachedRequestData columns must have one entry per request")

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(WireStruct, tag=1, dict=True, gc=True):
    """One step: which tokens every worker computes and where their KV goes.

    The step's request order is `scheduled_req_ids`: the handles of `scheduled_new_reqs`, then
    `scheduled_cached_reqs.req_ids`. `scheduled_token_counts[i]` is the number of tokens
    request i computes in this step (all > 0, summing to `total_num_scheduled_tokens`); it
    travels as one packed column, and `num_scheduled_tokens` is the same as a dict by handle.
    `finished_req_ids` lists handles finished since the previous step (workers drop them
    before applying anything else); `preempted_req_ids` lists handles preempted in this step
    (their KV is gone, but workers keep their tokens until they resume or finish).
    (`dict=True`, hence `gc=True`, holds the two cached properties.)
    """

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    scheduled_token_counts: IntColumn = msgspec.field(default_factory=IntColumn)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[int] = []
    preempted_req_ids: list[int] = []
    # Steps are numbered from 1 without gaps; a worker that sees a gap reports an error.
    step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.scheduled_token_counts, IntColumn):  # a hand-made message
            self.scheduled_token_counts = IntColumn.narrowest(self.scheduled_token_counts)
        num_reqs = len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs.req_ids)
        if len(self.scheduled_token_counts) != num_reqs:
            raise ValueError(f"{len(self.scheduled_token_counts)} token counts for "
                             f"{num_reqs} requests")

    @cached_property
    def scheduled_req_ids(self) -> list[int]:
        req_ids = [r.req_id for r in self.scheduled_new_reqs]
        req_ids.extend(self.scheduled_cached_reqs.req_ids)
        return req_ids

    @cached_property
    def num_scheduled_tokens(self) -> dict[int, int]:
        """Handle -> tokens scheduled in this step, in the step's request order."""
        return dict(zip(self.scheduled_req_ids, self.scheduled_token_counts))

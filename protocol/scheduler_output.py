"""The per-step plan the scheduler sends to every worker.

A request is named on this wire by `req_id`, a small integer handle the scheduler assigns when
it first schedules the request and recycles after the workers have been told it finished. The
external string id travels once, in `NewRequestData.request_id`.

Workers cache everything a request needs the first time they see it (`NewRequestData`); after
that only deltas travel (`CachedRequestData`), and the worker appends its own sampled tokens.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import msgspec

from protocol.wire_struct import WireStruct

from protocol.int_column import IntColumn
from protocol.sampling_params import SamplingParams


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


class TokenCounts(Mapping[int, int]):
    """`num_scheduled_tokens` (handle -> tokens this step), stored as `counts` parallel to the
    step's request order: `scheduled_new_reqs`, then `scheduled_cached_reqs.req_ids`.

    It travels as that packed column alone. The order is bound lazily to the message's request
    lists, and keyed lookups build an index on first use.
    """

    __slots__ = ("counts", "_new", "_cached", "_order", "_index")

    def __init__(self, counts: Iterable[int]) -> None:
        self.counts = counts if isinstance(counts, IntColumn) else IntColumn.narrowest(counts)
        self._new: list[NewRequestData] = []
        self._cached: Iterable[int] = ()
        self._order: list[int] | None = None
        self._index: dict[int, int] | None = None

    def bind(self, new_reqs: list[NewRequestData], cached_req_ids: Iterable[int]) -> None:
        self._new, self._cached, self._order, self._index = new_reqs, cached_req_ids, None, None

    @property
    def order(self) -> list[int]:
        if self._order is None:
            order = [r.req_id for r in self._new]
            order.extend(self._cached)
            self._order = order
        return self._order

    def __getitem__(self, req_id: int) -> int:
        if self._index is None:
            self._index = dict(zip(self.order, self.counts))
        return self._index[req_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.counts)

    def items(self):  # ordered (handle, count) pairs without building the index
        return zip(self.order, self.counts)

    def __repr__(self) -> str:
        return f"TokenCounts({dict(self.items())})"


class SchedulerOutput(WireStruct, tag=1):
    """One step: which tokens every worker computes and where their KV goes.

    Keys of `num_scheduled_tokens` are exactly the handles in `scheduled_new_reqs` and
    `scheduled_cached_reqs`, and its values sum to `total_num_scheduled_tokens`.
    `finished_req_ids` lists handles finished since the previous step (workers drop them
    before applying anything else); `preempted_req_ids` lists handles preempted in this step
    (their KV is gone, but workers keep their tokens until they resume or finish).
    """

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: TokenCounts = msgspec.field(default_factory=lambda: TokenCounts([]))
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[int] = []
    preempted_req_ids: list[int] = []
    # Steps are numbered from 1 without gaps; a worker that sees a gap reports an error.
    step: int = 0

    def __post_init__(self) -> None:
        counts = self.num_scheduled_tokens
        if not isinstance(counts, TokenCounts):  # a plain mapping from a hand-made message
            order = [r.req_id for r in self.scheduled_new_reqs]
            order.extend(self.scheduled_cached_reqs.req_ids)
            if len(counts) != len(order) or any(req_id not in counts for req_id in order):
                raise ValueError(f"num_scheduled_tokens keys {sorted(counts)} must be exactly "
                                 f"the scheduled handles {order}")
            self.num_scheduled_tokens = counts = TokenCounts([counts[h] for h in order])
        cached_ids = self.scheduled_cached_reqs.req_ids
        if len(counts) != len(self.scheduled_new_reqs) + len(cached_ids):
            raise ValueError(f"{len(counts)} token counts for "
                             f"{len(self.scheduled_new_reqs) + len(cached_ids)} requests")
        counts.bind(self.scheduled_new_reqs, cached_ids)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

"""The per-step plan the scheduler sends to every worker.

A request is named on this wire by `req_id`, a small integer handle the scheduler assigns when
it first schedules the request and recycles after the workers have been told it finished. The
external string id travels once, in `NewRequestData.request_id`.

Workers cache everything a request needs the first time they see it (`NewRequestData`); after
that only deltas travel (`CachedRequestData`), and the worker appends its own sampled tokens.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import ClassVar

import msgspec

from protocol.draft_tokens import DraftTokens
from protocol.int_column import IntColumn
from protocol.lora import LoRARequest
from protocol.pooling_params import PoolingParams
from protocol.sampling_params import SamplingParams
from protocol.wire_struct import WireStruct

# The largest step message a worker accepts (ZeroMQ refuses bigger frames before buffering
# them). New requests travel in full, so the scheduler admits at most MAX_NEW_PROMPT_TOKENS
# prompt tokens of new requests per step: each costs at most 5 bytes on the wire, and the
# rest of a step (params, block ids, deltas) stays far below the remaining room.
MAX_STEP_FRAME = 512 << 20
MAX_NEW_PROMPT_TOKENS = MAX_STEP_FRAME // 16


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
    lora_request: LoRARequest | None = None  # its adapter, which workers load by path
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled


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


class GrammarBitmask(WireStruct):
    """The tokens each constrained request may sample in this step.

    Row i belongs to handle `req_ids[i]` (in the step's request order; only requests that
    sample in this step and have a constraint). `bitmask` is the rows back to back, each
    `ceil(vocab_size / 32)` int32 words, little-endian: bit j of word w allows token
    `32 * w + j`. Every row allows at least one token.
    """

    req_ids: IntColumn
    bitmask: bytes


class ScheduledTokens(Mapping[int, int]):
    """`num_scheduled_tokens`: handle -> tokens computed in this step, read-only.

    It holds `counts`, one packed column in the step's request order, which is all that
    travels (a dict of 256 entries costs ~20 us more to encode and decode per step, and 1.5 B
    more per request); the handles are the owning message's `scheduled_req_ids`.
    """

    __slots__ = ("counts", "owner")

    def __init__(self, counts: IntColumn) -> None:
        self.counts = counts
        self.owner: SchedulerOutput | None = None

    def __getitem__(self, req_id: int) -> int:
        return self._by_handle[req_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self.owner.scheduled_req_ids)

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def _by_handle(self) -> dict[int, int]:
        return self.owner.num_scheduled_tokens_by_handle

    def __repr__(self) -> str:
        return f"ScheduledTokens({self._by_handle})"

    def __reduce__(self) -> tuple:  # the owner re-binds itself when it is rebuilt
        return ScheduledTokens, (self.counts,)


class SchedulerOutput(WireStruct, tag=1, dict=True, gc=True):
    """One step: which tokens every worker computes and where their KV goes.

    The step's request order is `scheduled_req_ids`: the handles of `scheduled_new_reqs`, then
    `scheduled_cached_reqs.req_ids`. `num_scheduled_tokens` maps each of them to the tokens it
    computes in this step (all > 0, summing to `total_num_scheduled_tokens`); built from a
    dict by hand, it travels as one packed column in request order (`scheduled_token_counts`).
    `finished_req_ids` lists handles finished since the previous step (workers drop them
    before applying anything else); `preempted_req_ids` lists handles preempted in this step
    (their KV is gone, but workers keep their tokens until they resume or finish).
    `grammar_bitmask` restricts what constrained requests may sample (every rank applies it).
    Steps come in three tags, so that each costs only what it uses: a plain step; a
    `MaskedSchedulerOutput` (masks, no drafts); a `SpecDecodeSchedulerOutput` (drafts to verify
    or to propose, and masks if any).
    (`dict=True`, hence `gc=True`, holds the cached properties.)
    """

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: ScheduledTokens = msgspec.field(
        default_factory=lambda: ScheduledTokens(IntColumn()))
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[int] = []
    preempted_req_ids: list[int] = []
    # Steps are numbered from 1 without gaps; a worker that sees a gap reports an error.
    step: int = 0
    # What the other variants carry; a plain step has no masks and verifies and proposes
    # nothing. (msgspec writes every field of an array-like struct up to its last non-default
    # one, so these stay off the plain step: steps without them encode exactly as before.)
    grammar_bitmask: ClassVar[GrammarBitmask | None] = None
    scheduled_spec_decode_tokens: ClassVar[DraftTokens | None] = None
    num_spec_tokens_to_propose: ClassVar[IntColumn | None] = None

    def __post_init__(self) -> None:
        tokens = self.num_scheduled_tokens
        if isinstance(tokens, Mapping) and not isinstance(tokens, ScheduledTokens):
            order = self.scheduled_req_ids  # a hand-made message: a dict by handle
            if sorted(tokens) != sorted(order):
                raise ValueError(f"num_scheduled_tokens keys {sorted(tokens)} must be exactly "
                                 f"the scheduled handles {order}")
            tokens = ScheduledTokens(IntColumn.narrowest(tokens[h] for h in order))
        elif not isinstance(tokens, ScheduledTokens):  # counts in request order
            tokens = ScheduledTokens(tokens if isinstance(tokens, IntColumn)
                                     else IntColumn.narrowest(tokens))
        self.num_scheduled_tokens = tokens
        num_reqs = len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs.req_ids)
        if len(tokens.counts) != num_reqs:
            raise ValueError(f"{len(tokens.counts)} token counts for {num_reqs} requests")
        propose = self.num_spec_tokens_to_propose
        if propose is not None and len(propose) != num_reqs:
            raise ValueError(f"{len(propose)} draft lengths to propose for {num_reqs} requests")
        tokens.owner = self

    @property
    def scheduled_token_counts(self) -> IntColumn:
        """Tokens per request, in the step's request order (what the wire carries)."""
        return self.num_scheduled_tokens.counts

    @cached_property
    def scheduled_req_ids(self) -> list[int]:
        req_ids = [r.req_id for r in self.scheduled_new_reqs]
        req_ids.extend(self.scheduled_cached_reqs.req_ids)
        return req_ids

    @cached_property
    def num_scheduled_tokens_by_handle(self) -> dict[int, int]:
        return dict(zip(self.scheduled_req_ids, self.scheduled_token_counts))

    def with_grammar_bitmask(self, grammar_bitmask: GrammarBitmask) -> SchedulerOutput:
        """This step, carrying the masks of its constrained requests: a plain step becomes a
        `MaskedSchedulerOutput`, a speculative one keeps its type."""
        kind = MaskedSchedulerOutput if type(self) is SchedulerOutput else type(self)
        fields = {name: getattr(self, name) for name in self.__struct_fields__}
        fields["grammar_bitmask"] = grammar_bitmask
        return kind(**fields)


class MaskedSchedulerOutput(SchedulerOutput, tag=3):
    """A step with constrained requests that sample and no drafts: `SchedulerOutput` plus
    their masks (one row per such request)."""

    grammar_bitmask: GrammarBitmask | None = None


class SpecDecodeSchedulerOutput(SchedulerOutput, tag=4):
    """A step with speculative decoding (its own tag, so that a plain step costs no byte more).

    `scheduled_spec_decode_tokens` names the draft tokens some requests verify, in the step's
    request order: such a request's count covers its known tokens, then its drafts. With a
    draft model, `num_spec_tokens_to_propose[i]` is how many draft tokens the workers propose
    after this step for the i-th scheduled request (None: none at all). `grammar_bitmask`,
    last so that a step without masks does not carry it, has a row per constrained request
    that samples, and for one that verifies d drafts, d + 1 consecutive rows: the mask at
    each verified position (after its known tokens, then after each of its drafts)."""

    scheduled_spec_decode_tokens: DraftTokens | None = None
    num_spec_tokens_to_propose: IntColumn | None = None
    grammar_bitmask: GrammarBitmask | None = None

"""Draft tokens of several requests, as packed columns (both directions of speculation)."""
from __future__ import annotations

from collections.abc import Iterator

import msgspec

from protocol.int_column import IntColumn
from protocol.wire_struct import WireStruct


class DraftTokens(WireStruct):
    """Request `req_ids[i]` has the draft tokens `token_ids[start_i:start_i + num_tokens[i]]`,
    `start_i = sum(num_tokens[:i])`; every `num_tokens[i] > 0`.

    In a step message (`scheduled_spec_decode_tokens`) they are the drafts the workers verify,
    listed in the step's request order; in rank 0's answer (`draft_token_ids`, draft models
    only) they are the workers' proposals for the next step.
    """

    req_ids: IntColumn = msgspec.field(default_factory=IntColumn)
    num_tokens: IntColumn = msgspec.field(default_factory=IntColumn)
    token_ids: IntColumn = msgspec.field(default_factory=IntColumn)

    def __post_init__(self) -> None:
        for name in ("req_ids", "num_tokens", "token_ids"):
            if not isinstance(getattr(self, name), IntColumn):  # a hand-made message
                setattr(self, name, IntColumn.narrowest(getattr(self, name)))
        if len(self.req_ids) != len(self.num_tokens):
            raise ValueError("DraftTokens needs one draft count per request")
        if sum(self.num_tokens) != len(self.token_ids) or 0 in self.num_tokens:
            raise ValueError("DraftTokens counts must be positive and add up to its tokens")

    @staticmethod
    def from_lists(req_ids: list[int], drafts: list[list[int]]) -> DraftTokens:
        """From one list of tokens per request (each non-empty)."""
        return DraftTokens(IntColumn.narrowest(req_ids),
                           IntColumn.narrowest(len(d) for d in drafts),
                           IntColumn.narrowest(t for d in drafts for t in d))

    def __len__(self) -> int:
        return len(self.req_ids)

    def items(self) -> Iterator[tuple[int, list[int]]]:
        """(handle, its draft tokens) in order."""
        tokens, start = self.token_ids.tolist(), 0
        for req_id, n in zip(self.req_ids, self.num_tokens):
            yield req_id, tokens[start:start + n]
            start += n

    def as_dict(self) -> dict[int, list[int]]:
        return dict(self.items())

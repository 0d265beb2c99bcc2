"""One request's speculation state: how many tokens it proposes next, adapted to acceptance."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A request whose drafts are rejected outright this many verifications in a row pauses
# proposing, for 1, 2, 4, ... steps (at most MAX_PAUSE), then tries one draft token again.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 64


@dataclass(slots=True)
class DraftState:
    """`length` is the number of draft tokens the request proposes next (1..max_length): it
    doubles while every draft is accepted and falls to one more than the accepted count
    otherwise, so a request whose text follows its proposals speculates far and one whose
    text does not speculates little, then not at all for a while (`pause`).

    `tokens[:num_tokens]` mirrors the request's `all_token_ids` for prompt lookup (numpy, grown
    by appending what is new since the last proposal)."""

    max_length: int
    length: int = 0
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # proposals still to skip
    tokens: np.ndarray | None = None
    num_tokens: int = 0

    def __post_init__(self) -> None:
        self.length = self.length or self.max_length

    def next_length(self) -> int:
        """Draft tokens to propose now (0 while paused)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """The target verified `num_drafts` proposals and accepted the first `num_accepted`."""
        if num_accepted == num_drafts:
            self.length = min(self.max_length, 2 * max(self.length, num_drafts))
        else:
            self.length = num_accepted + 1
        self.misses = self.misses + 1 if num_accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.pause = min(MAX_PAUSE, 1 << (self.misses - MISSES_BEFORE_PAUSE))

    def synced_tokens(self, all_token_ids: list[int]) -> np.ndarray:
        """The request's tokens as int32, with those appended since the last call added."""
        n = len(all_token_ids)
        if self.tokens is None or n > len(self.tokens):
            grown = np.empty(max(2 * n, 64), np.int32)
            if self.tokens is not None:
                grown[:self.num_tokens] = self.tokens[:self.num_tokens]
            self.tokens = grown
        if n > self.num_tokens:
            self.tokens[self.num_tokens:n] = all_token_ids[self.num_tokens:]
        self.num_tokens = n
        return self.tokens[:n]

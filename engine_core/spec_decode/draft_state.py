"""One request's speculation state: how many tokens it proposes next, from what was accepted."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# What one step costs besides its tokens, in tokens: reading every weight once is worth
# this many tokens' compute (the machine's FLOPs per weight byte read; on the CPUs here, for
# float32, about 20-30). A draft token is nearly free while a step has few tokens and costs
# a token's compute once steps are compute-bound.
STEP_COST_IN_TOKENS = 24
DECAY = 0.8  # weight of the acceptance history at each draft token tried (~5 remembered)
PRIOR = (1.4, 2.0)  # (accepted, tried) pseudo-counts: an acceptance rate of 0.7 at first
MAX_PROBE_INTERVAL = 64


@dataclass(slots=True)
class DraftState:
    """`accepted / tried` estimates the chance that the request's next draft token is
    accepted given the ones before it were: counts over the draft tokens it tried, each
    earlier one weighing DECAY times less (a verification that accepted a of d drafts tried
    a + 1 of them, or d if all were accepted). The request proposes the
    number of tokens L that maximizes its expected tokens per step, (1 - a^(L+1)) / (1 - a),
    per cost, STEP_COST_IN_TOKENS / batch + 1 + L: far while its text follows its proposals
    or the batch is small, not at all when a draft would cost more than it is likely to
    save. Then it still tries one token after 1, 2, 4, ... steps (`probe_interval`), so it
    notices when its text starts to follow proposals again.

    `tokens[:num_tokens]` mirrors the request's `all_token_ids` for prompt lookup (numpy, grown
    by appending what is new since the last proposal)."""

    max_length: int
    accepted: float = PRIOR[0]
    tried: float = PRIOR[1]
    skipped: int = 0  # steps without a proposal since the last one
    probe_interval: int = 1
    tokens: np.ndarray | None = None
    num_tokens: int = 0

    def next_length(self, batch_size: int) -> int:
        """Draft tokens to propose now, when the step has `batch_size` requests."""
        length = _best_length(self.accepted / self.tried, STEP_COST_IN_TOKENS / batch_size,
                              self.max_length)
        if length:
            self.skipped = 0
            return length
        self.skipped += 1
        if self.skipped < self.probe_interval:
            return 0
        self.skipped, self.probe_interval = 0, min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        return 1

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """The target verified `num_drafts` proposals and accepted the first `num_accepted`."""
        run = DECAY ** num_accepted  # a accepted tries, then maybe a rejected one
        added = (1.0 - run) / (1.0 - DECAY)
        self.accepted = run * self.accepted + added
        self.tried = run * self.tried + added
        if num_accepted < num_drafts:
            self.accepted, self.tried = DECAY * self.accepted, DECAY * self.tried + 1.0
        if num_accepted:
            self.probe_interval = 1

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


def _best_length(rate: float, fixed: float, max_length: int) -> int:
    """argmax over L in [0, max_length] of (1 + rate + ... + rate^L) / (fixed + 1 + L); the
    ratio rises, then falls, so the first fall ends the search."""
    best, value = 0, 1.0 / (fixed + 1.0)
    expected, power = 1.0, 1.0
    for length in range(1, max_length + 1):
        power *= rate
        expected += power
        candidate = expected / (fixed + 1.0 + length)
        if candidate <= value:
            break
        best, value = length, candidate
    return best

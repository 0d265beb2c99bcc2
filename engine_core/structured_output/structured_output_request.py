"""One constrained request's grammar state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StructuredOutputRequest:
    """The request's llguidance matcher, advanced by exactly the tokens the request sampled
    under a mask (a row of a step's `GrammarBitmask`), in order. Preemption rewinds nothing:
    recompute re-reads the prompt and outputs the matcher has already accepted. (A
    constraint that starts after a model's reasoning is one grammar with the reasoning in
    it, built by the front-end: every constrained token is masked.)
    """

    matcher: Any

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over tokens sampled under this request's mask; False if the grammar
        refused one (the matcher is then in its error state for good)."""
        matcher = self.matcher
        for token in token_ids:
            if matcher.is_stopped():  # the grammar ended: only its end token (EOS) follows
                continue
            if not matcher.consume_token(token):
                return False
        return True

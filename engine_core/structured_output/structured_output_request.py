"""One constrained request's grammar state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.work_lanes import Job
from engine_core.structured_output.mask_row import MaskRow


@dataclass(slots=True)
class StructuredOutputRequest:
    """The request's llguidance matcher, advanced by exactly the tokens the request sampled
    under a mask (a row of a step's `GrammarBitmask`), in order. Preemption rewinds nothing:
    recompute re-reads the prompt and outputs the matcher has already accepted. (A
    constraint that starts after a model's reasoning is one grammar with the reasoning in
    it, built by the front-end: every constrained token is masked.)

    `row` is the mask after the accepted tokens once it is known; `job` computes it in the
    background meanwhile (MaskPipeline), and while it runs nothing else touches the matcher.
    `cost` is what the last mask took, which decides the lane of the next one.
    """

    matcher: Any
    key: tuple[str, str, bool, bool | None]
    kind: str
    row: MaskRow | None = None
    job: Job | None = None
    cost: float = 0.0

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

    def error(self) -> str:
        """The matcher's error, "" if it has none."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

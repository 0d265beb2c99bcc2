"""The draft tokens one step verifies, laid out along the step's logits rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SpecDecodeMetadata:
    """For the step's sampled requests, in logits order: request r verifies the draft tokens
    `draft_token_ids[cu_num_drafts[r]:cu_num_drafts[r + 1]]` and owns logits rows
    `[logits_start[r], logits_start[r] + num_draft_tokens[r] + 1)`: row j is the target's
    distribution for the token after its first j drafts (j = 0: after its known tokens).
    Requests without drafts have one row, like a plain step.

    `draft_probs[r]` [num_draft_tokens[r], vocab] is the distribution a draft model drew
    request r's drafts from (random sampling only); None for n-gram drafts, which have
    probability 1 under their proposer."""

    num_draft_tokens: np.ndarray  # [R] int64
    draft_token_ids: np.ndarray  # [D] int64
    draft_probs: list[torch.Tensor | None] | None = None

    @property
    def logits_start(self) -> np.ndarray:
        counts = self.num_draft_tokens + 1
        return np.cumsum(counts) - counts

    @property
    def cu_num_drafts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.num_draft_tokens)))

    @property
    def num_logits(self) -> int:
        return int(self.num_draft_tokens.sum()) + len(self.num_draft_tokens)

    def row_offsets(self) -> np.ndarray:
        """[num_logits] for each logits row, how many of its request's drafts precede it."""
        counts = self.num_draft_tokens + 1
        return np.arange(int(counts.sum())) - np.repeat(self.logits_start, counts)

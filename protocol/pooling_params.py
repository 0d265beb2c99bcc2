"""Pooling parameters: what a pooling request (embed, classify, score) asks of the pooler
(vLLM's `PoolingParams`: `task`, `dimensions`, `use_activation`), validated on construction
and decode."""
from __future__ import annotations

from typing import Literal

from protocol.wire_struct import WireStruct

PoolingTask = Literal["embed", "classify", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "token_embed", "token_classify")
# The largest embedding size a request may ask to truncate to (far above any model's).
MAX_DIMENSIONS = 1 << 20


class PoolingParams(WireStruct):
    """How to pool one request's hidden states.

    `task` picks the pooler: `embed` (one vector per prompt: the model's pooling, then
    `dimensions` and L2 normalization), `classify` (the classifier head's logits, then
    softmax or sigmoid), `token_embed`/`token_classify` (the same per prompt token). None:
    the model's own task, filled in by the front-end. `dimensions` truncates an embedding
    (Matryoshka models only); `use_activation` (vLLM's name; `normalize` in older vLLM)
    switches the normalization or the classifier's activation (None: on).
    """

    task: PoolingTask | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None  # use_activation's older name, folded into it

    def __post_init__(self) -> None:
        if self.normalize is not None:
            if type(self.normalize) is not bool:
                raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
            if self.use_activation is not None and self.use_activation != self.normalize:
                raise ValueError("normalize and use_activation disagree (normalize is "
                                 "use_activation's older name)")
            self.use_activation, self.normalize = self.normalize, None
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got "
                             f"{self.task!r}")
        if self.dimensions is not None:
            if type(self.dimensions) is not int:
                raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
            if not 1 <= self.dimensions <= MAX_DIMENSIONS:
                raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.use_activation is not None and type(self.use_activation) is not bool:
            raise ValueError(f"use_activation must be a boolean, got {self.use_activation!r}")

    @property
    def activation(self) -> bool:
        return self.use_activation is not False

    @property
    def per_token(self) -> bool:
        """One output row per prompt token (needs every position's hidden state)."""
        return self.task in ("token_embed", "token_classify")

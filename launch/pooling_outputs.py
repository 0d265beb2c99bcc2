"""Results of pooling calls (`LLM.encode`, `embed`, `classify`, `score`), shaped like vLLM's:
a request output holding one task-specific output. Pooled data are numpy float32 arrays
(vLLM gives torch tensors; both have `.shape` and `.tolist()`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

O = TypeVar("O")


@dataclass(slots=True)
class PoolingOutput:
    """What the pooler returned: [dim] for a sequence task, [prompt_tokens, dim] per token."""

    data: np.ndarray


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # the classifier's outputs (activation applied unless switched off)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput(Generic[O]):
    request_id: str
    outputs: O
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
    error: str | None = None  # why the engine failed it (then `outputs` is empty)
    metrics: dict = field(default_factory=dict)


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


def as_embedding(out: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
    """(an output that failed: an empty embedding, its `error` saying why, as vLLM's)"""
    return _retyped(out, EmbeddingOutput(_vector(out).tolist()))


def as_classification(out: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
    return _retyped(out, ClassificationOutput(_vector(out).tolist()))


def _vector(out: PoolingRequestOutput[PoolingOutput]) -> np.ndarray:
    data = out.outputs.data
    if out.error is not None:
        return np.zeros(0, np.float32)
    if data.ndim != 1:
        raise ValueError(f"expected one vector per prompt, got shape {data.shape}")
    return data


def _retyped(out: PoolingRequestOutput, outputs: object) -> PoolingRequestOutput:
    return PoolingRequestOutput(out.request_id, outputs, out.prompt_token_ids, out.finished,
                                out.num_cached_tokens, out.prompt, out.error, out.metrics)

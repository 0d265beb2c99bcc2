"""Scores of text pairs, shared by `LLM.score` and the /score and /rerank routes (vLLM's
rules): an embedding model scores a pair by the cosine of the two texts' embeddings (a
bi-encoder), a classifier with one label by its output on the pair as one prompt (a
cross-encoder). Pairs are 1:1, 1:N (the first text against each of the others) or N:N."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from launch.processing.pooling import PoolingModelInfo, encode_pair

MAX_SCORE_TEXTS = 1024  # texts on either side of one scoring request


@dataclass(frozen=True)
class ScoringPlan:
    """What to pool for N pairs: `prompts` (embed: the first side, then the second; classify:
    one prompt per pair) and the `task` to pool them with."""

    task: str
    prompts: list[Any]
    num_pairs: int
    num_first: int  # embed: prompts before the second side's

    def scores(self, results: list[np.ndarray]) -> list[float]:
        """The pairs' scores from the pooled `results` (in `prompts` order)."""
        if self.task == "classify":
            return [float(r[0]) for r in results]
        first, second = results[:self.num_first], results[self.num_first:]
        if len(first) == 1:
            first = first * len(second)
        return [cosine(a, b) for a, b in zip(first, second)]


def plan_scoring(info: PoolingModelInfo, tokenizer: Any, data_1: Any, data_2: Any,
                 ) -> ScoringPlan:
    """ValueError naming `data_1`/`data_2` (the /score route's `text_1`/`text_2`) for a
    shape that is not 1:1, 1:N or N:N, or a model that cannot score."""
    first, second = _texts(data_1, "text_1"), _texts(data_2, "text_2")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"text_1 must hold one text or as many as text_2 (1:1, 1:N or N:N), "
                         f"got {len(first)} and {len(second)}")
    if info.task == "embed":
        return ScoringPlan("embed", first + second, len(second), len(first))
    if len(info.labels) != 1:
        raise ValueError(f"scoring needs a classifier with one label (a cross-encoder); this "
                         f"model has {len(info.labels)}")
    if tokenizer is None:
        raise ValueError("scoring text pairs needs the model's tokenizer")
    if len(first) == 1:
        first = first * len(second)
    prompts = [{"prompt": a + b, "prompt_token_ids": encode_pair(tokenizer, a, b)}
               if info.use_sep_token else a + b for a, b in zip(first, second)]
    return ScoringPlan("classify", prompts, len(second), len(second))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm > 0 else 0.0


def _texts(data: Any, name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else data
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a list of strings")
    if not texts:
        raise ValueError(f"{name} must hold at least one text")
    if len(texts) > MAX_SCORE_TEXTS:
        raise ValueError(f"{name} must hold at most {MAX_SCORE_TEXTS} texts, got {len(texts)}")
    return texts

"""Pooling requests in the front-end: what the served pooling model does (its task, sizes,
labels), and a request's `PoolingParams` resolved and checked against it (vLLM's
`PoolingParams.verify`), so that a bad one is a ValueError naming the field before anything
is sent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from protocol import EngineConfig, PoolingParams
from protocol.pooler_config import read_model_config

GENERATE_ONLY = ("this model runs with --runner generate: it generates text and does not "
                 "pool (embeddings, classification, scores need a server started with "
                 "--runner pooling)")
POOLING_ONLY = ("this model runs with --runner pooling: it embeds or classifies and "
                "generates no text (use /v1/embeddings, /pooling, /score or /rerank; offline, "
                "LLM.embed, classify, score or encode)")


@dataclass(frozen=True)
class PooledInput:
    """A validated pooling prompt and its resolved parameters."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams


@dataclass(frozen=True)
class PoolingModelInfo:
    """The served pooling model as requests see it."""

    task: str  # "embed" or "classify": what `task=None` means
    pooling_type: str
    hidden_size: int
    labels: list[str]  # a classifier's id2label, in id order
    matryoshka_dimensions: list[int] | None
    is_matryoshka: bool
    activation: bool  # use_activation's default
    dimensions: int | None  # the embedding size requests get unless they say
    use_sep_token: bool  # pair scoring: tokenizer(text, text_pair); else the texts joined

    @staticmethod
    def of(config: EngineConfig) -> PoolingModelInfo | None:
        """None for a generating engine; `config` must be resolved (`with_runner`)."""
        pooler = config.pooler_config
        if config.runner != "pooling" or pooler is None:
            return None
        hf = read_model_config(config.model)
        id2label = hf.get("id2label") if isinstance(hf.get("id2label"), dict) else {}
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                  for i in range(len(id2label) or int(hf.get("num_labels") or 2))]
        dims = hf.get("matryoshka_dimensions")
        return PoolingModelInfo(
            task=config.convert, pooling_type=pooler.seq_pooling,
            hidden_size=int(hf.get("hidden_size", 0)), labels=labels,
            matryoshka_dimensions=list(dims) if dims else None,
            is_matryoshka=bool(dims) or bool(hf.get("is_matryoshka")),
            activation=pooler.activation, dimensions=pooler.dimensions,
            use_sep_token=bool(hf.get("use_sep_token", True)))

    @property
    def tasks(self) -> tuple[str, str]:
        return self.task, f"token_{self.task}"

    def resolve(self, params: PoolingParams | None, task: str | None = None) -> PoolingParams:
        """`params` (None: defaults) for `task` (None: the params' own, else the model's),
        with the model's defaults filled in; ValueError for what this model cannot do."""
        if params is None:
            params = PoolingParams()
        elif not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got "
                             f"{type(params).__name__}")
        params = msgspec.structs.replace(params)  # re-validates a possibly mutated object
        if task is not None and params.task is not None and params.task != task:
            raise ValueError(f"task must be {task!r} here, got {params.task!r}")
        task = task or params.task or self.task
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not supported by this model, which serves "
                             f"{' and '.join(map(repr, self.tasks))} (--convert "
                             f"{'classify' if 'classify' in task else 'embed'} serves "
                             f"{task!r})")
        dimensions = params.dimensions
        if task.endswith("embed"):
            if dimensions is None:
                dimensions = self.dimensions
            self._check_dimensions(dimensions, params.dimensions is not None)
        elif dimensions is not None:
            raise ValueError(f"dimensions must be unset for task {task!r} (it applies to "
                             "embeddings)")
        activation = self.activation if params.use_activation is None else params.use_activation
        return PoolingParams(task, dimensions, activation)

    def _check_dimensions(self, dimensions: int | None, asked: bool) -> None:
        if dimensions is None or dimensions == self.hidden_size:
            return
        if asked and not self.is_matryoshka:
            raise ValueError(f"dimensions must be unset: this model does not support "
                             f"Matryoshka embeddings (got dimensions={dimensions}; its "
                             f"embeddings have {self.hidden_size})")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {self.matryoshka_dimensions} for this "
                             f"model, got {dimensions}")


def truncate(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int,
             side: str) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: at most that many tokens (-1: max_model_len), the
    first ones (`side` "right") or the last ("left")."""
    if truncate_prompt_tokens is None:
        return token_ids
    if type(truncate_prompt_tokens) is not int or truncate_prompt_tokens < -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or a non-negative integer, got "
                         f"{truncate_prompt_tokens!r}")
    limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if len(token_ids) <= limit:
        return token_ids
    return token_ids[-limit:] if side == "left" and limit else token_ids[:limit]


def encode_pair(tokenizer: Any, first: str, second: str) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding (its special tokens
    between and around the texts, as `tokenizer(text, text_pair)`)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and hasattr(inner, "encode") and not callable(tokenizer):
        return inner.encode(first, second, add_special_tokens=True).ids
    return list(tokenizer(text=first, text_pair=second)["input_ids"])

"""A generating model's decoder as a pooling model (vLLM's `as_embedding_model` and
`as_seq_cls_model`): the LM head dropped, and for `classify` a `score` head (hidden size ->
labels, float32, replicated on every rank) as `*ForSequenceClassification` checkpoints store
it. Checkpoints saved from the bare decoder (`Qwen3Model`: names without `model.`) load too."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from worker.attention.kv_cache_spec import KVCacheSpec


def num_labels(hf: dict[str, Any]) -> int:
    """A classifier's outputs: `id2label`'s size, as transformers reads it (default 2)."""
    labels = hf.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(hf.get("num_labels") or 2)


class PoolingModel(nn.Module):
    """`lm`'s decoder (`lm.model`, its parameters still named `model.*`) and, for classify,
    `score`. `forward` returns the final norm's hidden states, as the generating model's
    does; the runner's pooler reads them."""

    def __init__(self, lm: nn.Module, convert: str) -> None:
        super().__init__()
        self.config = lm.config
        self.packed_modules = lm.packed_modules
        self.convert = convert
        self.model = lm.model
        self.lm_head = None  # what weights_summary and tied-weight checks look for
        self._kv_cache_spec = type(lm).kv_cache_spec
        self.score: nn.Linear | None = None
        if convert == "classify":
            self.score = nn.Linear(lm.config.hidden_size, num_labels(lm.config.hf), bias=False,
                                   dtype=torch.float32)
            self.score.keep_float32 = True  # a head in float32, as vLLM's head_dtype
        # The decoder can return only some token rows' final states (`out_rows`).
        self.selects_rows = "out_rows" in inspect.signature(self.model.forward).parameters

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                metadata: Any, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[num_tokens, hidden]; with `out_rows` (only if `selects_rows`), [n, hidden] for
        those token rows."""
        if out_rows is None:
            return self.model(input_ids, positions, kv_caches, metadata)
        return self.model(input_ids, positions, kv_caches, metadata, out_rows=out_rows)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self._kv_cache_spec(self)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden] float32 -> [n, labels] logits."""
        return self.score(pooled)

    def checkpoint_name(self, name: str) -> str | None:
        """Where a checkpoint tensor goes (None: not used). The LM head is not used; a
        bare decoder's names get the `model.` prefix."""
        if name.startswith("lm_head."):
            return None
        if name.startswith("score."):
            return name if self.score is not None else None
        return name if name.startswith("model.") else f"model.{name}"

"""The attention backend interface (the KV cache layout is in kv_cache_spec.py)."""
from __future__ import annotations

from typing import Protocol

import torch

from worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: AttentionMetadata) -> None:
        """Per-step preparation shared by all layers (stored in `metadata.plan`)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Write `key`/`value` [num_tokens, num_kv_heads, head_dim] into their slots, then
        attend `query` [num_tokens, num_heads, head_dim]; returns [num_tokens, num_heads,
        head_dim]. Every layer of a step writes before it reads, so a request may attend
        KV written by another request in the same step (shared prefix blocks)."""

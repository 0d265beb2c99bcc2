"""The attention backend interface, and the KV cache layout every backend shares."""
from __future__ import annotations

from typing import Protocol

import torch

from worker.attention.metadata import AttentionMetadata

# KV cache layout, per layer: a key and a value tensor, each
#   [num_blocks, block_size, num_kv_heads, head_dim]   (token-major within a block, "NHD")
# Slot s (from slot_mapping) is row s of the tensor viewed as [num_blocks * block_size, ...].
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key, value) cache tensors


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

"""The paged KV cache every attention backend shares: its layout and one rank's spec of it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# KV cache layout, per layer: a key and a value tensor, each
#   [num_blocks, block_size, num_kv_heads, head_size]   (token-major within a block, "NHD")
# Slot s (from slot_mapping) is row s of the tensor viewed as [num_blocks * block_size, ...].
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key, value) cache tensors


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a model keeps in the KV cache on one rank: a (key, value) pair per layer."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_size: int
    dtype: torch.dtype

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One key (or value) tensor's shape."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_size)

    def bytes_per_block(self, block_size: int) -> int:
        """Key + value of every layer for one block of tokens."""
        return (2 * self.num_layers * block_size * self.num_kv_heads * self.head_size
                * self.dtype.itemsize)

"""The paged KV cache every attention backend shares: its layout and one rank's spec of it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# KV cache layout, per layer: a key and a value tensor, each
#   [num_blocks, block_size, num_kv_heads, head_size]   (token-major within a block, "NHD")
# Slot s (from slot_mapping) is row s of the tensor viewed as [num_blocks * block_size, ...].
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key, value) cache tensors


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share a block table: the same attention window (0: full attention)."""

    sliding_window: int
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a model keeps in the KV cache on one rank: a (key, value) pair per layer, and each
    layer's attention window (`sliding_windows[i]`, 0: full attention; empty: all full)."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_size: int
    dtype: torch.dtype
    sliding_windows: tuple[int, ...] = ()
    hybrid: bool = True  # False: one full-attention group, whatever the windows

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One key (or value) tensor's shape."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_size)

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def groups(self) -> list[KVCacheGroup]:
        """The layers in groups of equal size, one kind of attention each, full attention
        first (vLLM's uniform-page grouping): the group size is the smallest kind's layer
        count (or the largest's, when they are within 25 %), each kind's layers in order cut
        into groups of that size (its last may be smaller). One kind: one group. Without
        `hybrid`, all layers are one full-attention group (each still attends its window)."""
        kinds: dict[int, list[int]] = {}
        for layer in range(self.num_layers):
            kinds.setdefault(self.window(layer) if self.hybrid else 0, []).append(layer)
        counts = [len(layers) for layers in kinds.values()]
        size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
        return [KVCacheGroup(window, tuple(layers[i:i + size]))
                for window, layers in sorted(kinds.items())
                for i in range(0, len(layers), size)]

    def group_size(self) -> int:
        """Layers per group: a block holds this many layers' K and V."""
        return max(len(group.layers) for group in self.groups())

    def bytes_per_block(self, block_size: int) -> int:
        """Key + value of one group's layers for one block of tokens."""
        return (2 * self.group_size() * block_size * self.num_kv_heads * self.head_size
                * self.dtype.itemsize)

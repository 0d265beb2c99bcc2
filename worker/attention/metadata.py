"""What every attention layer needs to place and attend one step's flat token batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Shared by all layers of one step; built once by the model runner.

    The step's tokens are one flat batch: request i owns rows
    `[query_start_loc[i], query_start_loc[i + 1])` of q/k/v (its `query_len` new tokens). After
    this step it has `seq_lens[i]` tokens, the first `context_len = seq_len - query_len` of which
    were computed earlier (prefix-cache hits, earlier chunks, earlier decodes) and are read
    from the cache through `block_table[i]`. Query token j sits at absolute position
    `context_len + j` and attends keys `[0, context_len + j]` (causal, bottom-right aligned).
    Decode rows are just requests with `query_len == 1`. With `sliding_window` w > 0, query
    token j attends keys `[max(0, context_len + j - w + 1), context_len + j]` only, and the
    block table's entries before those keys' blocks may be stale or the null block (never
    read).

    A model whose layers keep their KV in several groups (sliding-window and full-attention
    layers) gets one metadata per group, differing in `slot_mapping`, `block_table` and
    `sliding_window`; `for_layer(i)` is layer i's.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; < 0 skips
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32; unused entries are 0 (null block)
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, so backends never sync to read them
    seq_lens_cpu: list[int]
    plan: Any = field(default=None)  # the backend's per-step preparation, reused by all layers
    sliding_window: int = 0  # 0: full attention
    by_layer: list[AttentionMetadata] | None = None  # per layer, where groups differ
    # Per-step preparation the groups' backends share (one dict for all of a step's groups).
    shared: dict[Any, Any] = field(default_factory=dict)

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self if self.by_layer is None else self.by_layer[layer]

    def groups(self) -> list[AttentionMetadata]:
        """Every distinct group's metadata (this one first)."""
        if self.by_layer is None:
            return [self]
        seen = {id(self): self}
        for m in self.by_layer:
            seen.setdefault(id(m), m)
        return list(seen.values())

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

"""What the prefix cache published and evicted since it was last asked, as KV-cache events."""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)
from protocol.lora import LoRARequest


@dataclass(slots=True)
class KVEventLog:
    """Events in the order the pool changed. It starts with AllBlocksCleared: a new pool is
    empty, so a consumer holding an earlier engine's blocks for this endpoint drops them."""

    block_size: int
    events: list[KVEvent] = field(default_factory=lambda: [AllBlocksCleared()])

    def stored(self, indices: list[int], block_hashes: list[bytes], token_ids: list[int],
               extra_keys: tuple[int | str, ...], lora: LoRARequest | None = None) -> None:
        """Blocks `indices` (ascending) of one sequence were published: one BlockStored per
        run of consecutive blocks, whose parent is the block before the run. A LoRA
        adapter's blocks carry its `lora_id` and `lora_name`, and as each block's extra keys
        its name (vLLM's untagged form of its hash keys)."""
        if lora is not None:
            extra_keys = (lora.lora_name,)
        start = 0
        for end in range(1, len(indices) + 1):
            if end == len(indices) or indices[end] != indices[end - 1] + 1:
                self._stored_run(indices[start], indices[end - 1] + 1, block_hashes,
                                 token_ids, extra_keys, lora)
                start = end

    def removed(self, block_hashes: list[bytes]) -> None:
        self.events.append(BlockRemoved([external_block_hash(h) for h in block_hashes],
                                        MEDIUM))

    def take(self) -> list[KVEvent]:
        events = self.events
        if events:  # the step loop asks every iteration: no garbage while nothing changed
            self.events = []
        return events

    def _stored_run(self, first: int, stop: int, block_hashes: list[bytes],
                    token_ids: list[int], extra_keys: tuple[int | str, ...],
                    lora: LoRARequest | None) -> None:
        bs = self.block_size
        parent = external_block_hash(block_hashes[first - 1]) if first else None
        self.events.append(BlockStored(
            [external_block_hash(h) for h in block_hashes[first:stop]], parent,
            token_ids[first * bs:stop * bs], bs, lora and lora.lora_int_id, MEDIUM,
            lora and lora.lora_name, [extra_keys] * (stop - first) if extra_keys else None))

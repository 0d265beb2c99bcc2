"""KV-cache block metadata and the free list that doubles as the LRU eviction order."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block; the tensors live in the workers.

    `block_hash` is set while the block is published in the prefix cache; it survives a free
    (lazy eviction) and is cleared only when the block is reused for other tokens.
    `prev_free`/`next_free` thread the block through the free list while `ref_cnt == 0`.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """A doubly linked list threaded through the blocks themselves, between two sentinels.

    The head is evicted first: blocks freed together are appended in the order given (callers
    free a request's blocks tail first, so the block holding the most tokens goes first), and a
    block touched by a prefix hit leaves from the middle in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} available")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail; raises ValueError if the links are inconsistent."""
        blocks, block = [], self._head
        while block.next_free is not self._tail:
            nxt = block.next_free
            if nxt is None or nxt.prev_free is not block or len(blocks) > self.num_free_blocks:
                raise ValueError(f"free list broken after block {block.block_id}")
            blocks.append(nxt)
            block = nxt
        if self._tail.prev_free is not block:
            raise ValueError("free list tail does not link back to the last free block")
        return blocks

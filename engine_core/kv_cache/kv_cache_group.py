"""One layer group's blocks per request: full attention keeps every block of a sequence, a
sliding window only those its window can still see (vLLM's single-type managers).

All groups of a model advance together: a request's block list has the same length in every
group (block i holds tokens `[i*block_size, (i+1)*block_size)`), and a sliding-window group
puts the null block where blocks have left its window. Blocks come from one shared pool.
"""
from __future__ import annotations

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.free_block_queue import KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionGroup:
    """Every block of a request stays until the request is freed."""

    sliding_window = 0

    def __init__(self, index: int, pool: BlockPool, block_size: int) -> None:
        self.index = index
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def max_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` slots holds here at once, computed in
        steps of at most `max_step_tokens` slots."""
        return cdiv(num_tokens, self.block_size)

    def first_needed(self, num_computed: int) -> int:
        """The first block a step starting at token `num_computed` reads."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Free the request's blocks no later step reads (none for full attention)."""

    def longest_hit(self, hashes: list[bytes]) -> int:
        """The most leading blocks of `hashes` (a prompt's chained block hashes) a prefix hit
        may cover in this group: here, all of them cached."""
        get, index = self.pool.get_cached_block, self.index
        for i, block_hash in enumerate(hashes):
            if get(block_hash, index) is None:
                return i
        return len(hashes)

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of a hit of `num_blocks` blocks (null where not needed)."""
        get = self.pool.get_cached_block
        return [get(h, self.index) for h in hashes[:num_blocks]]

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (it holds the most specific KV, so
        it should be evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class SlidingWindowGroup(FullAttentionGroup):
    """Token p attends keys `[p - window + 1, p]`: a step starting at token c reads blocks from
    `(c - window + 1) // block_size` on, so blocks before it are freed (kept cached, in the
    free list, when prefix caching is on) and replaced by the null block."""

    def __init__(self, index: int, pool: BlockPool, block_size: int, window: int) -> None:
        super().__init__(index, pool, block_size)
        self.sliding_window = window

    def max_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        live = cdiv(self.sliding_window - 1 + max_step_tokens, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), live)

    def first_needed(self, num_computed: int) -> int:
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.pool.null_block
        removed = []
        for i in range(min(self.first_needed(num_computed), len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before it left earlier
            removed.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(removed)

    def longest_hit(self, hashes: list[bytes]) -> int:
        """The largest k such that blocks `[first_needed(k * block_size), k)` are cached: a
        request resuming at token k * block_size reads exactly those. Scans from the right;
        each block is looked up about once."""
        get, index = self.pool.get_cached_block, self.index
        k = len(hashes)
        while k > 0:
            if get(hashes[k - 1], index) is None:
                k -= 1
                continue
            start, need = k - 1, self.first_needed(k * self.block_size)
            while start > need and get(hashes[start - 1], index) is not None:
                start -= 1
            if start <= need:
                return k
            k = start - 1  # a hit ending inside this run would need its missing block too
        return 0

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        first = self.first_needed(num_blocks * self.block_size)
        get = self.pool.get_cached_block
        return ([self.pool.null_block] * first
                + [get(h, self.index) for h in hashes[first:num_blocks]])

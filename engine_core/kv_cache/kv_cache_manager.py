"""Which blocks hold which request's KV, with automatic prefix caching."""
from __future__ import annotations

import hashlib
from array import array

from engine_core.kv_cache.block_pool import BlockPool, IntegrityError
from engine_core.kv_cache.free_block_queue import KVCacheBlock
from engine_core.request import Request


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int],
                      extra_keys: tuple[int | str, ...] = ()) -> bytes:
    """Chained block hash: equal hashes mean equal token prefixes, not just equal blocks.
    `extra_keys` (e.g. an adapter id) set apart blocks whose KV differs for the same tokens;
    none (the default) hashes exactly the tokens."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("i", token_ids).tobytes())
    if extra_keys:
        h.update(b"\0extra" + repr(extra_keys).encode())
    return h.digest()


class KVCacheManager:
    """Allocates blocks to requests on top of a `BlockPool`.

    A request's block i holds its tokens `[i*block_size, (i+1)*block_size)`. Full blocks are
    published in the prefix cache under their chained hash as soon as the step that computes
    their last token is scheduled, so a request admitted in the same step can already share
    them (each layer writes the step's KV before it attends).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already published (or skipped as duplicates).
        self.num_cached_block: dict[str, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, capped so its last token is recomputed
        (the model must run on at least one token to produce logits). None for a request
        that must compute every position (a pooling request that reads them all)."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       full_sequence_must_fit: bool = False,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens, and room for
        `num_lookahead_tokens` after them (slots a draft model writes ahead).

            | computed | new computed (hits) | new (this step) | lookahead | rest of the sequence
            0          num_computed_tokens   +num_new_computed +num_new_tokens

        New tokens past `num_tokens` (draft tokens) are computed but never published in the
        prefix cache. Returns the ids of newly allocated blocks (possibly none), or None if
        the pool cannot supply them, in which case no state changed. With
        `full_sequence_must_fit`, blocks for the whole current sequence must fit, though only
        this step's are allocated.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and new_computed_blocks is None and not full_sequence_must_fit:
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= len(blocks) * self.block_size:  # no new block
                if self.enable_caching and end // self.block_size > self.num_cached_block[
                        request.request_id]:
                    self._cache_full_blocks(request, blocks, min(end, request.num_tokens))
                return []
        hits = new_computed_blocks or []
        num_held = len(blocks) if blocks is not None else 0
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-(end + num_lookahead_tokens) // self.block_size) - num_held - len(hits)
        needed = max(num_new_blocks, 0)
        if full_sequence_must_fit:
            needed = max(needed, -(-request.num_tokens // self.block_size) - num_held - len(hits))
        if hits:
            needed += sum(1 for block in hits if block.ref_cnt == 0)  # touching un-frees them
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_block[request.request_id] = len(hits)
        if hits:
            self.block_pool.touch(hits)
            blocks.extend(hits)
        new_ids: list[int] = []
        if num_new_blocks > 0:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            new_ids = [block.block_id for block in new_blocks]
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(end, request.num_tokens))
        return new_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (it holds the most specific KV, so
        it should be evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks hold."""
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def publish_end(self, request_id: str) -> int | None:
        """The computed length at which the request fills a block not yet published (None:
        caching is off, or it holds no blocks). For a request that has blocks,
        `allocate_slots(request, n)` changes nothing and returns [] while
        `num_computed_tokens + n` stays below this and within `num_slots`."""
        num_cached = self.num_cached_block.get(request_id)
        if not self.enable_caching or num_cached is None:
            return None
        return (num_cached + 1) * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        """Audit the pool against the ref counts implied by every request's block list."""
        holders: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            if self.num_cached_block.get(request_id, 0) > len(blocks):
                raise IntegrityError(f"request {request_id} caches more blocks than it holds")
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        self.block_pool.check_integrity(holders)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[request.request_id]
        if num_full <= num_cached:
            return
        self._extend_block_hashes(request, num_full)
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full,
                                          request.all_token_ids, request.block_hash_extra_keys)
        self.num_cached_block[request.request_id] = num_full

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens, extra = request.all_token_ids, request.block_hash_extra_keys
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra)
            hashes.append(parent)

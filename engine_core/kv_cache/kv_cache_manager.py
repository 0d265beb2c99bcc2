"""Which blocks hold which request's KV, with automatic prefix caching."""
from __future__ import annotations

import hashlib
from array import array

from engine_core.kv_cache.block_pool import BlockPool, IntegrityError
from engine_core.kv_cache.free_block_queue import KVCacheBlock
from engine_core.kv_cache.kv_cache_group import FullAttentionGroup, SlidingWindowGroup
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
    """Allocates blocks to requests on top of a `BlockPool`, for every layer group of the model
    (vLLM's hybrid KV-cache coordinator).

    A model's layers form groups of equal size (the workers' `kv_cache_groups`), each with
    its attention window (`sliding_windows[g]`, 0 for full attention) and its own block per
    token range: a request's block i holds its tokens `[i*block_size, (i+1)*block_size)` in
    every group, and a sliding-window group keeps only the blocks its window can still see
    (null blocks before them). Full blocks are published in the prefix cache under their
    chained hash (per group) as soon as the step that computes their last token is
    scheduled, so a request admitted in the same step can already share them (each layer
    writes the step's KV before it attends). Block ids travel group-major: a request's list
    (or a step's new blocks) is group 0's, then group 1's, ..., all of equal length.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: tuple[int, ...] = (0,), max_step_tokens: int = 0) -> None:
        """`max_step_tokens`: the most KV slots a request takes in one step (token budget
        plus lookahead); it bounds what a sliding-window group holds per request."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.sliding_windows = tuple(sliding_windows) or (0,)
        self.max_step_tokens = max_step_tokens
        self.groups = [SlidingWindowGroup(g, self.block_pool, block_size, w) if w
                       else FullAttentionGroup(g, self.block_pool, block_size)
                       for g, w in enumerate(self.sliding_windows)]
        self._windowed = [group for group in self.groups if group.sliding_window]
        # Group 0's lists: which blocks (and how many) each request holds.
        self.req_to_blocks = self.groups[0].req_to_blocks
        # Leading blocks of each request already published (or skipped as duplicates).
        self.num_cached_block: dict[str, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def blocks_for_sequence(self, num_tokens: int) -> list[int]:
        """Per group, the most blocks one sequence of `num_tokens` tokens holds at once."""
        return [group.max_blocks(num_tokens, self.max_step_tokens or num_tokens)
                for group in self.groups]

    def max_sequence_tokens(self, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) the whole cache holds by itself."""
        usable = self.num_usable_blocks
        low, high = 0, limit  # sum(blocks_for_sequence) grows with the length
        while low < high:
            mid = (low + high + 1) // 2
            if sum(self.blocks_for_sequence(mid)) <= usable:
                low = mid
            else:
                high = mid - 1
        return low

    def get_computed_blocks(self, request: Request,
                            ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest cached prefix of the request that every group can resume from (per
        group its blocks, null where a window no longer reads), capped so its last token is
        recomputed (the model must run on at least one token to produce logits). Nothing for
        a request that must compute every position (a pooling request that reads them all)."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return tuple([] for _ in self.groups), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, max_blocks)
        hashes = request.block_hashes[:max_blocks]
        # Shrink k until no group asks for less: a window's hit must end where its blocks are.
        k, settled, i = len(hashes), 0, 0
        while settled < len(self.groups):
            found = self.groups[i % len(self.groups)].longest_hit(hashes[:k])
            settled = 1 if found < k else settled + 1
            k, i = found, i + 1
        return tuple(group.hit_blocks(hashes, k) for group in self.groups), k * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: tuple[list[KVCacheBlock], ...] | None = None,
                       full_sequence_must_fit: bool = False,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens, and room for
        `num_lookahead_tokens` after them (slots a draft model writes ahead).

            | computed | new computed (hits) | new (this step) | lookahead | rest of the sequence
            0          num_computed_tokens   +num_new_computed +num_new_tokens

        New tokens past `num_tokens` (draft tokens) are computed but never published in the
        prefix cache. Returns the ids of newly allocated blocks (possibly none; group-major),
        or None if the pool cannot supply them, in which case nothing changed but windows
        dropping blocks no step reads any more. With `full_sequence_must_fit`, blocks for the
        whole current sequence must fit (as each group would hold them), though only this
        step's are allocated.
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None and new_computed_blocks is None and not full_sequence_must_fit:
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead_tokens <= len(blocks) * self.block_size:  # no new block
                if self.enable_caching and end // self.block_size > self.num_cached_block[
                        request_id]:
                    self._cache_full_blocks(request, min(end, request.num_tokens))
                return []
        for group in self._windowed:
            group.remove_skipped_blocks(request_id, request.num_computed_tokens)
        hits = new_computed_blocks or tuple([] for _ in self.groups)
        num_held = len(blocks) if blocks is not None else 0
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-(end + num_lookahead_tokens) // self.block_size) - num_held - len(hits[0])
        needed = self._blocks_needed(request, max(num_new_blocks, 0), hits,
                                     full_sequence_must_fit)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if blocks is None:
            self.num_cached_block[request_id] = len(hits[0])
        new_ids = self._take_blocks(request_id, hits, num_new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, min(end, request.num_tokens))
        return new_ids

    def _take_blocks(self, request_id: str, hits: tuple[list[KVCacheBlock], ...],
                     num_new_blocks: int) -> list[int]:
        """Append each group's hits, then `num_new_blocks` new blocks per group, to the
        request's block lists; the new blocks' ids (group-major). Every group's hits leave the
        free list before any new block is taken from it (a new block for one group could
        otherwise evict another group's hit)."""
        for group, group_hits in zip(self.groups, hits):
            group_blocks = group.req_to_blocks.setdefault(request_id, [])
            if group_hits:
                self.block_pool.touch(group_hits)
                group_blocks.extend(group_hits)
        new_ids: list[int] = []
        for group in self.groups:
            group_blocks = group.req_to_blocks[request_id]
            if num_new_blocks > 0:
                new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
                group_blocks.extend(new_blocks)
                new_ids += [block.block_id for block in new_blocks]
        return new_ids

    def _blocks_needed(self, request: Request, num_new_blocks: int,
                       hits: tuple[list[KVCacheBlock], ...], full_sequence_must_fit: bool) -> int:
        """Free blocks an allocation takes: new ones in every group, and hits that were free
        (touching un-frees them); with `full_sequence_must_fit`, each group's new blocks
        cover what it would hold of the whole current sequence."""
        needed = num_new_blocks * len(self.groups)
        if full_sequence_must_fit:
            whole = self.blocks_for_sequence(request.num_tokens)
            needed = 0
            for group, group_hits, most in zip(self.groups, hits, whole):
                held = sum(not b.is_null for b in group.req_to_blocks.get(request.request_id, ()))
                held += sum(not b.is_null for b in group_hits)
                needed += max(num_new_blocks, most - held)
        for group_hits in hits:
            needed += sum(1 for block in group_hits if block.ref_cnt == 0 and not block.is_null)
        return needed

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, each list last block first."""
        self.num_cached_block.pop(request.request_id, None)
        for group in reversed(self.groups):
            group.free(request.request_id)

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
        """The request's blocks, group-major (null blocks as 0)."""
        return [block.block_id for group in self.groups
                for block in group.req_to_blocks.get(request_id, ())]

    def num_blocks_by_group(self) -> list[int]:
        """Blocks the running requests hold in each group (shared ones counted once)."""
        return [len({id(b) for blocks in group.req_to_blocks.values() for b in blocks
                     if not b.is_null}) for group in self.groups]

    def check_integrity(self) -> None:
        """Audit the pool against the ref counts implied by every group's block lists."""
        holders: dict[int, int] = {}
        for group in self.groups:
            for request_id, blocks in group.req_to_blocks.items():
                if len(blocks) != len(self.req_to_blocks.get(request_id, ())):
                    raise IntegrityError(f"request {request_id}: group {group.index} holds "
                                         f"{len(blocks)} blocks, group 0 "
                                         f"{len(self.req_to_blocks.get(request_id, ()))}")
                if self.num_cached_block.get(request_id, 0) > len(blocks):
                    raise IntegrityError(f"request {request_id} caches more blocks than it holds")
                for block in blocks:
                    if block.is_null:
                        if not group.sliding_window:
                            raise IntegrityError(f"request {request_id}: a null block in "
                                                 f"full-attention group {group.index}")
                        continue
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        self.block_pool.check_integrity(holders)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[request.request_id]
        if num_full <= num_cached:
            return
        self._extend_block_hashes(request, num_full)
        for group in self.groups:
            self.block_pool.cache_full_blocks(
                group.req_to_blocks[request.request_id], request.block_hashes, num_cached,
                num_full, request.all_token_ids, request.block_hash_extra_keys, group.index,
                request.lora_request)
        self.num_cached_block[request.request_id] = num_full

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens, extra = request.all_token_ids, request.block_hash_extra_keys
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra)
            hashes.append(parent)

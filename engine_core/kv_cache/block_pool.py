"""The pool of KV-cache blocks: ref counts, the free list, and the prefix-cache hash map."""
from __future__ import annotations

from collections.abc import Iterable

from engine_core.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock
from engine_core.kv_cache.kv_event_log import KVEventLog
from protocol.kv_events import KVEvent
from protocol.lora import LoRARequest

HASH_BYTES = 16  # hash_block_tokens' digest: a key of this length is group 0's


class IntegrityError(RuntimeError):
    """The block pool's bookkeeping is inconsistent."""


def group_key(block_hash: bytes, group: int) -> bytes:
    """A block hash qualified by its layer group: groups hold different layers' KV for the
    same tokens, so each publishes its own block under its own key (group 0's is the hash
    itself, so a one-group model's keys, and all KV events, are the plain hashes)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class BlockPool:
    """Owns every block's metadata; the blocks of all layer groups come from this one pool
    (a block is one group's KV of `block_size` tokens).

    Invariants (audited by `check_integrity`): block 0 is the null block, never allocated,
    counted or hashed (a sliding-window group's list holds it where blocks left the window);
    a block is in the free list iff its `ref_cnt` is 0; `block_hash` is set iff the block is
    the value of that key in `cached_block_hash_to_block` (one block per key: a block whose
    key is already published stays unpublished).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # Every publish and eviction of a hash, in order, while KV events are on.
        self.kv_events: KVEventLog | None = None

    def record_kv_events(self, block_size: int) -> None:
        """From now on, log a BlockStored for each published block and a BlockRemoved for
        each evicted hash (after an AllBlocksCleared: the log starts from an empty cache)."""
        if self.cached_block_hash_to_block:
            raise RuntimeError("KV events must be on before the first block is cached")
        self.kv_events = KVEventLog(block_size)

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv_events.take() if self.kv_events is not None else []

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (the null block excluded)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(group_key(block_hash, group))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free list, evicting their old hashes."""
        blocks = self.free_block_queue.popleft_n(n)
        evicted = [] if self.kv_events is not None else None
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                if evicted is not None and len(block.block_hash) == HASH_BYTES:  # group 0
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        if evicted:
            self.kv_events.removed(evicted)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit that was free leaves the free list.
        Null blocks (a sliding window's skipped ones) are nobody's: left alone."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail of the free list in order
        (null blocks are skipped)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          num_cached: int, num_full: int, token_ids: list[int] = (),
                          extra_keys: tuple[int | str, ...] = (), group: int = 0,
                          lora: LoRARequest | None = None) -> None:
        """Publish layer group `group`'s `blocks[num_cached:num_full]` under
        `block_hashes[num_cached:num_full]` (`token_ids`, the sequence's tokens, its hash
        `extra_keys` and its adapter `lora` only go into KV events, which group 0 alone
        reports: a prefix is cached where group 0 holds it). Null blocks are skipped."""
        table = self.cached_block_hash_to_block
        published = [] if self.kv_events is not None and group == 0 else None
        for i in range(num_cached, num_full):
            block, block_hash = blocks[i], group_key(block_hashes[i], group)
            if block.block_hash is None and not block.is_null and block_hash not in table:
                block.block_hash = block_hash
                table[block_hash] = block
                if published is not None:
                    published.append(i)
        if published:
            self.kv_events.stored(published, block_hashes, token_ids, extra_keys, lora)

    def check_integrity(self, expected_ref_cnts: dict[int, int] | None = None) -> None:
        """Verify free list, ref counts and hash map; raise IntegrityError on any mismatch.

        `expected_ref_cnts` (block id -> holders), when given, must equal every block's count.
        """
        try:
            free = self.free_block_queue.get_all_free_blocks()
        except ValueError as e:
            raise IntegrityError(str(e)) from None
        free_ids = {b.block_id for b in free}
        _require(len(free_ids) == len(free) == self.get_num_free_blocks(),
                 f"free list holds {len(free)} entries ({len(free_ids)} distinct), "
                 f"counter says {self.get_num_free_blocks()}")
        null = self.null_block
        _require(null.block_id == 0 and null.is_null and null.ref_cnt == 0
                 and null.block_hash is None and 0 not in free_ids, "null block 0 was used")
        for block in self.blocks[1:]:
            in_free = block.block_id in free_ids
            _require(block.ref_cnt >= 0 and (block.ref_cnt == 0) == in_free,
                     f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free list: {in_free}")
            if expected_ref_cnts is not None:
                want = expected_ref_cnts.get(block.block_id, 0)
                _require(block.ref_cnt == want,
                         f"block {block.block_id}: ref_cnt {block.ref_cnt}, {want} holders")
            if block.block_hash is not None:
                _require(self.cached_block_hash_to_block.get(block.block_hash) is block,
                         f"block {block.block_id} has a hash the map does not point back to")
        for block_hash, block in self.cached_block_hash_to_block.items():
            _require(block.block_hash == block_hash and not block.is_null,
                     f"hash map entry for block {block.block_id} does not match its hash")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)

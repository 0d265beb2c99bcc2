"""FreeBlockQueue and BlockPool: LRU order, lazy eviction, and the integrity audit."""
from __future__ import annotations

import pytest

from engine_core.kv_cache.block_pool import BlockPool, IntegrityError
from engine_core.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 5 and _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])  # O(1) from the middle relinks the neighbours
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert _ids(queue.get_all_free_blocks()) == [1, 3, 4, 2]
    assert _ids(queue.popleft_n(4)) == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)


def test_null_block_and_allocation():
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 5 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert _ids(blocks) == [1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(0.4)
    pool.check_integrity({1: 1, 2: 1})


def test_lazy_eviction_and_touch():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h1", b"h2"], 0, 2)
    pool.free_blocks([b, a])  # tail first
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1]
    assert pool.get_cached_block(b"h1") is a  # freed but still a hit
    pool.touch([a])  # a hit un-frees it
    assert a.ref_cnt == 1 and _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2]
    (c,) = pool.get_new_blocks(1)
    assert c.block_id == 3
    (d,) = pool.get_new_blocks(1)  # reuses block 2 and evicts its hash
    assert d is b and b.block_hash is None and pool.get_cached_block(b"h2") is None
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_duplicate_hash_stays_unpublished():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.check_integrity()


@pytest.mark.parametrize("corrupt,message", [
    (lambda p, a: setattr(a, "ref_cnt", 0), "ref_cnt 0, in free list: False"),
    (lambda p, a: setattr(p.blocks[3], "ref_cnt", 2), "ref_cnt 2, in free list: True"),
    (lambda p, a: setattr(p.free_block_queue, "num_free_blocks", 9), "counter says 9"),
    (lambda p, a: setattr(p.blocks[2], "next_free", p.blocks[4]), "free list broken"),
    (lambda p, a: setattr(a, "block_hash", b"x"), "does not point back"),
    (lambda p, a: p.cached_block_hash_to_block.__setitem__(b"y", a), "does not match"),
    (lambda p, a: setattr(p.null_block, "ref_cnt", 1), "null block"),
])
def test_integrity_catches_corruption(corrupt, message):
    pool = BlockPool(6)
    (a,) = pool.get_new_blocks(1)
    pool.check_integrity({a.block_id: 1})
    corrupt(pool, a)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity()


def test_integrity_checks_expected_holders():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(IntegrityError, match="ref_cnt 1, 2 holders"):
        pool.check_integrity({a.block_id: 2})

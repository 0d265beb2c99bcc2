"""KVCacheManager: prefix hits, hash chains, allocation, eviction order (vLLM's scenarios)."""
from __future__ import annotations

import pytest

from engine_core.kv_cache.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine_core.request import Request
from protocol import SamplingParams


def _req(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=100))


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def _allocate(manager: KVCacheManager, req: Request) -> list[int]:
    hits, num_hit = manager.get_computed_blocks(req)
    new_ids = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    return new_ids


def test_prefill_hits_and_eviction_order():
    manager = KVCacheManager(11, 16)
    common = list(range(48))
    req0 = _req("0", common + [100] * 7)
    assert manager.get_computed_blocks(req0) == (([],), 0)
    assert _allocate(manager, req0) == [1, 2, 3, 4]
    blocks = manager.req_to_blocks["0"]
    parent = None
    for i in range(3):  # full blocks are hashed as a chain
        parent = hash_block_tokens(parent, common[16 * i:16 * (i + 1)])
        assert blocks[i].block_hash == parent and blocks[i].ref_cnt == 1
    assert blocks[3].block_hash is None

    req1 = _req("1", common + [200] * 5)
    hits, num_hit = manager.get_computed_blocks(req1)
    assert [b.block_id for b in hits[0]] == [1, 2, 3] and num_hit == 48
    assert manager.allocate_slots(req1, 5, 48, hits) == [5]
    assert [b.ref_cnt for b in hits[0]] == [2, 2, 2] and manager.block_pool.get_num_free_blocks() == 5
    manager.check_integrity()

    manager.free(req0)
    manager.free(req1)
    assert _free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    req2 = _req("2", common + [7] * 6)
    hits, num_hit = manager.get_computed_blocks(req2)
    assert [b.block_id for b in hits[0]] == [1, 2, 3]
    assert manager.allocate_slots(req2, 6, 48, hits) == [6]
    req3 = _req("3", [99] * 160)
    assert manager.allocate_slots(req3, 16) == [7]  # LRU head first
    manager.check_integrity()


def test_eviction_takes_lru_then_longest_prefix():
    manager = KVCacheManager(11, 16)
    req0, req1 = _req("0", list(range(87))), _req("1", list(range(100, 148)))
    assert _allocate(manager, req0) == [1, 2, 3, 4, 5, 6]
    assert _allocate(manager, req1) == [7, 8, 9]
    manager.free(req0)
    manager.free(req1)
    assert _free_ids(manager) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    req2 = _req("2", list(range(35)))
    hits, num_hit = manager.get_computed_blocks(req2)
    assert [b.block_id for b in hits[0]] == [1, 2] and num_hit == 32
    assert manager.allocate_slots(req2, 3, 32, hits) == [10]
    assert manager.block_pool.get_num_free_blocks() == 7


def test_decode_publishes_a_block_when_it_fills():
    manager = KVCacheManager(11, 16)
    req = _req("0", list(range(55)))
    _allocate(manager, req)
    for token in range(9):
        req.append_output_token_ids(token)
    assert manager.allocate_slots(req, 4) == []  # 59 tokens still fit 4 blocks
    req.num_computed_tokens = 59
    assert manager.req_to_blocks["0"][3].block_hash is None
    for token in range(10):
        req.append_output_token_ids(token)
    assert manager.allocate_slots(req, 10) == [5]  # 69 tokens need a 5th block
    assert manager.req_to_blocks["0"][3].block_hash == req.block_hashes[3]


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = KVCacheManager(11, 16)
    _allocate(manager, _req("0", list(range(48))))
    hits, num_hit = manager.get_computed_blocks(_req("1", list(range(48))))
    assert len(hits[0]) == 2 and num_hit == 32


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(5, 16)
    req0 = _req("0", list(range(32)))
    _allocate(manager, req0)
    manager.free(req0)  # blocks 1, 2 are free but still cached
    _allocate(manager, _req("x", [7] * 16))  # takes block 3 (head of the free list)
    req1 = _req("1", list(range(32)) + [5] * 40)
    hits, num_hit = manager.get_computed_blocks(req1)
    assert num_hit == 32 and [b.ref_cnt for b in hits[0]] == [0, 0]
    free_before = _free_ids(manager)
    assert manager.allocate_slots(req1, 40, num_hit, hits) is None
    assert [b.ref_cnt for b in hits[0]] == [0, 0] and _free_ids(manager) == free_before
    assert "1" not in manager.req_to_blocks
    manager.check_integrity()


def test_full_sequence_gate():
    manager = KVCacheManager(5, 16)  # 4 usable blocks
    req = _req("0", list(range(80)))  # needs 5 blocks in all
    assert manager.allocate_slots(req, 16, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(req, 16) == [1]


def test_caching_disabled():
    manager = KVCacheManager(5, 4, enable_caching=False)
    assert _allocate(manager, _req("0", list(range(10)))) == [1, 2, 3]
    req1 = _req("1", list(range(10)))
    assert manager.get_computed_blocks(req1) == (([],), 0)
    assert manager.allocate_slots(req1, 10) is None
    assert not manager.block_pool.cached_block_hash_to_block


def test_free_releases_in_reverse_and_integrity_holds():
    manager = KVCacheManager(8, 4)
    reqs = [_req(str(i), [i] * 9) for i in range(2)]
    for r in reqs:
        _allocate(manager, r)
    manager.free(reqs[0])
    assert _free_ids(manager)[-3:] == [3, 2, 1]
    manager.check_integrity()
    manager.free(reqs[1])
    assert manager.block_pool.get_num_free_blocks() == 7
    with pytest.raises(Exception):
        manager.block_pool.check_integrity({4: 1})


def test_extra_keys_keep_blocks_apart():
    """Blocks whose hash carries different extra keys (e.g. two adapters) never alias; the
    same keys share, and no keys hash exactly the tokens."""
    manager = KVCacheManager(11, 16)
    tokens = list(range(40))
    first = Request("a", tokens, SamplingParams(max_tokens=8), block_hash_extra_keys=(1,))
    _allocate(manager, first)
    other = Request("b", tokens, SamplingParams(max_tokens=8), block_hash_extra_keys=(2,))
    assert manager.get_computed_blocks(other) == (([],), 0)
    same = Request("c", tokens, SamplingParams(max_tokens=8), block_hash_extra_keys=(1,))
    assert manager.get_computed_blocks(same)[1] == 32
    plain = _req("d", tokens)
    assert manager.get_computed_blocks(plain) == (([],), 0)
    assert hash_block_tokens(None, tokens[:16], ()) == hash_block_tokens(None, tokens[:16])
    manager.check_integrity()

"""Tiny exact tests of the block pool: 11 blocks of 16 tokens, exact block ids, counts and events."""

import hashlib
import struct

import pytest

from engine.block_pool import ROOT_HASH, BlockEvent, BlockPool, NoFreeBlocks, hash_block, hash_blocks
from policies.eviction import TenantEvictionPolicy, TenantQuota

BS = 16
EXTRA = b"model\x00tenant-a"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make_pool(quotas=None, clock=None) -> BlockPool:
    return BlockPool(11, BS, TenantEvictionPolicy(quotas or {}), clock=clock or Clock())


def toks(i: int) -> list[int]:
    """The tokens of block i of a made-up prompt."""
    return list(range(i * BS, (i + 1) * BS))


def cache_chain(pool: BlockPool, blocks, tenant="a", domain="a", extra=EXTRA):
    """Register blocks as the chain of toks(0), toks(1), ...; returns the hashes."""
    hashes, parent = [], None
    for i, b in enumerate(blocks):
        h = hash_block(parent, toks(i), extra)
        assert pool.cache_full_block(b, h, parent, tenant, domain)
        hashes.append(h)
        parent = h
    return hashes


def ids(blocks):
    return [b.block_id for b in blocks]


# -- hashing --------------------------------------------------------------------------------
def test_hash_is_stable_sha256_of_parent_tokens_extra():
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<16I", *toks(0)) + EXTRA).digest()[:16]
    assert hash_block(None, toks(0), EXTRA) == expected  # not Python's salted hash()
    h0 = hash_block(None, toks(0), EXTRA)
    assert hash_block(h0, toks(1), EXTRA) == hashlib.sha256(h0 + struct.pack("<16I", *toks(1)) + EXTRA).digest()[:16]


def test_hash_depends_on_parent_tokens_and_domain():
    h = hash_block(None, toks(0), EXTRA)
    assert hash_block(None, toks(0), b"model\x00tenant-b") != h
    assert hash_block(None, toks(0), b"other\x00tenant-a") != h
    assert hash_block(h, toks(0), EXTRA) != h
    assert hash_block(None, toks(0)[:-1] + [999], EXTRA) != h


def test_hash_blocks_covers_full_blocks_only():
    tokens = toks(0) + toks(1) + [7, 8, 9]
    hs = hash_blocks(tokens, BS, EXTRA)
    assert len(hs) == 2
    assert hs == [hash_block(None, toks(0), EXTRA), hash_block(hs[0], toks(1), EXTRA)]
    assert hash_blocks(toks(0)[:15], BS, EXTRA) == []


# -- allocation and free --------------------------------------------------------------------
def test_allocate_lowest_ids_first_and_free_counts():
    pool = make_pool()
    assert pool.num_free_blocks() == 11
    a = pool.allocate(3, "a")
    assert ids(a) == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks() == 8 and pool.num_in_use() == 3
    b = pool.allocate(2, "b")
    assert ids(b) == [3, 4] and pool.num_free_blocks() == 6
    pool.free(a)
    assert pool.num_free_blocks() == 9 and [x.ref_cnt for x in a] == [0, 0, 0]
    # uncached blocks go back to the free list; freeing runs tail first, so the head is reused first
    assert ids(pool.allocate(4, "c")) == [0, 1, 2, 5]
    pool.check_invariants()


def test_allocate_too_many_raises_and_changes_nothing():
    pool = make_pool()
    pool.allocate(4, "a")
    with pytest.raises(NoFreeBlocks):
        pool.allocate(8, "a")
    assert pool.num_free_blocks() == 7 and pool.num_in_use() == 4
    assert ids(pool.allocate(7, "a")) == [4, 5, 6, 7, 8, 9, 10]
    assert pool.num_free_blocks() == 0
    pool.check_invariants()


def test_double_free_is_detected():
    pool = make_pool()
    blocks = pool.allocate(2, "a")
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free(blocks)


def test_touch_of_a_free_block_is_detected():
    pool = make_pool()
    with pytest.raises(AssertionError, match="touch of free block 0"):
        pool.touch([pool.blocks[0]])


# -- prefix cache ---------------------------------------------------------------------------
def test_cache_hit_refcounts_and_free_counts():
    pool = make_pool()
    blocks = pool.allocate(3, "a")
    h = cache_chain(pool, blocks[:2])  # the third block is a partial block: never cached
    assert pool.take_events() == [BlockEvent("stored", h[0], None, "a"), BlockEvent("stored", h[1], h[0], "a")]
    assert pool.take_events() == []
    pool.free(blocks)
    assert pool.num_free_blocks() == 11 and pool.eviction.num_evictable() == 2
    assert pool.get_cached_block(h[0]) is pool.blocks[0] and pool.get_cached_block(h[1]) is pool.blocks[1]
    # two requests hit the same prefix: shared blocks, refcount 2
    hit = [pool.get_cached_block(x) for x in h]
    pool.touch(hit)
    pool.touch(hit)
    assert [b.ref_cnt for b in hit] == [2, 2] and pool.num_free_blocks() == 9
    pool.free(hit)
    assert [b.ref_cnt for b in hit] == [1, 1] and pool.num_free_blocks() == 9
    pool.free(hit)
    assert [b.ref_cnt for b in hit] == [0, 0] and pool.num_free_blocks() == 11
    assert pool.get_cached_block(h[0]) is pool.blocks[0]  # still cached after release
    pool.check_invariants()


def test_free_list_is_used_before_evicting_and_tail_blocks_are_evicted_first():
    pool = make_pool()
    blocks = pool.allocate(3, "a")
    h = cache_chain(pool, blocks)
    pool.free(blocks)
    pool.take_events()
    got = pool.allocate(8, "b")  # exactly the 8 never-cached blocks
    assert ids(got) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert all(pool.get_cached_block(x) is not None for x in h) and pool.take_events() == []
    got2 = pool.allocate(1, "b")
    assert ids(got2) == [2]  # the chain's tail goes first: the head stays useful to others
    assert pool.get_cached_block(h[2]) is None and pool.get_cached_block(h[1]) is pool.blocks[1]
    assert pool.take_events() == [BlockEvent("removed", h[2], h[1], "a")]
    assert pool.blocks[2].block_hash is None and pool.blocks[2].ref_cnt == 1
    assert pool.stats["a"].evictions == 1 and pool.eviction.held["a"] == 2
    assert ids(pool.allocate(2, "b")) == [1, 0]
    assert pool.num_free_blocks() == 0
    pool.check_invariants()


def test_duplicate_hash_leaves_the_second_block_private():
    pool = make_pool()
    a, b = pool.allocate(1, "a"), pool.allocate(1, "a")
    h = hash_block(None, toks(0), EXTRA)
    assert pool.cache_full_block(a[0], h, None, "a", "a")
    assert not pool.cache_full_block(b[0], h, None, "a", "a")  # computed concurrently
    assert pool.cache_full_block(a[0], h, None, "a", "a")  # re-registering is a no-op
    assert len(pool.take_events()) == 1
    pool.free(b)
    assert pool.blocks[1].block_hash is None and pool.eviction.num_evictable() == 0
    pool.free(a)
    assert pool.get_cached_block(h) is pool.blocks[0] and pool.eviction.num_evictable() == 1
    pool.check_invariants()


def test_reset_prefix_cache_keeps_in_use_blocks():
    pool = make_pool()
    blocks = pool.allocate(3, "a")
    h = cache_chain(pool, blocks)
    pool.free(blocks[1:])  # block 0 stays in use; 1 and 2 evictable
    pool.take_events()
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(h[0]) is pool.blocks[0]
    assert pool.get_cached_block(h[1]) is None and pool.get_cached_block(h[2]) is None
    assert {e.kind for e in pool.take_events()} == {"removed"}
    assert pool.num_free_blocks() == 10
    assert pool.cached_hashes() == [(h[0], None, "a")]
    pool.check_invariants()


# -- policy through the pool ----------------------------------------------------------------
def test_ttl_sweep_evicts_expired_blocks():
    clock = Clock()
    pool = make_pool({"a": TenantQuota(ttl_s=5.0)}, clock)
    blocks = pool.allocate(2, "a")
    h = cache_chain(pool, blocks)
    pool.free(blocks)
    clock.t = 4.9
    assert pool.evict_expired() == 0
    clock.t = 5.0
    assert pool.evict_expired() == 2
    assert pool.get_cached_block(h[0]) is None and pool.num_free_blocks() == 11
    pool.check_invariants()


def test_cap_is_enforced_on_release():
    pool = make_pool({"a": TenantQuota(max_blocks=2)})
    blocks = pool.allocate(4, "a")
    h = cache_chain(pool, blocks)  # 4 cached while in use: allowed
    pool.take_events()
    pool.free(blocks)
    # tail first: blocks 3 and 2 are the oldest releases and go
    assert [pool.get_cached_block(x) is not None for x in h] == [True, True, False, False]
    assert [e.block_hash for e in pool.take_events()] == [h[3], h[2]]
    assert pool.eviction.held["a"] == 2 and pool.stats["a"].evictions == 2
    pool.check_invariants()


def test_other_tenants_minimum_is_never_free_for_me_not_even_when_the_pool_is_idle():
    pool = make_pool({"a": TenantQuota(min_blocks=3)})
    blocks = pool.allocate(4, "a")
    h = cache_chain(pool, blocks)
    pool.free(blocks)
    assert pool.num_free_blocks() == 11
    # idle pool: a's 3 guaranteed blocks are still not b's (no last-resort eviction)
    assert pool.num_free_blocks("b") == 8 and pool.capacity("b") == 8 and pool.capacity("a") == 11
    mine = pool.allocate(8, "b")  # 7 free + a's one block above its minimum (the chain's tail)
    assert pool.get_cached_block(h[3]) is None and pool.eviction.held["a"] == 3
    assert pool.num_free_blocks("b") == 0 and pool.num_free_blocks("a") == 3 and pool.num_free_blocks() == 3
    # a may recycle its own guarantee, b may not take it
    assert pool.can_allocate(1, "a") and not pool.can_allocate(1, "b")
    pool.free(mine)
    pool.check_invariants()
    assert pool.num_free_blocks("b") == 8
    with pytest.raises(NoFreeBlocks):
        pool.allocate(9, "b")
    assert pool.eviction.held["a"] == 3 and all(pool.get_cached_block(x) for x in h[:3])
    pool.check_invariants()


def test_low_priority_demand_evicts_its_own_class_first_through_the_pool():
    clock = Clock()
    pool = make_pool({"hi": TenantQuota(priority=1)}, clock)
    hi = pool.allocate(2, "hi")
    h_hi = cache_chain(pool, hi, tenant="hi", domain="hi")
    pool.free(hi)  # released first: older
    clock.t = 1.0
    lo = pool.allocate(2, "lo")
    h_lo = cache_chain(pool, lo, tenant="lo", domain="lo", extra=b"model\x00lo")
    pool.free(lo)
    pool.allocate(7, "x")
    assert ids(pool.allocate(2, "lo")) == [3, 2]  # lo's own, not hi's older blocks
    assert all(pool.get_cached_block(x) for x in h_hi) and not any(pool.get_cached_block(x) for x in h_lo)
    pool.check_invariants()

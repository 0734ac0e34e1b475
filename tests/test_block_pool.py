"""Block pool: refcounts, caching, eviction order, verified hits and the integrity check."""

from __future__ import annotations

import pytest

from workers.engine.block_pool import BlockPool, hash_block


def test_allocate_release_cache_and_evict_oldest():
    pool = BlockPool(4, 2)
    a, b, c, d = pool.allocate(4)
    pool.register(a, hash_block(0, [1, 2]), 0, [1, 2])
    pool.register(b, hash_block(0, [3, 4]), 0, [3, 4])
    pool.release([a, b, c])
    pool.check_integrity([[d]])
    assert (len(pool.free), len(pool.cached), pool.num_available) == (1, 2, 3)
    assert pool.allocate(2) == [c, a], "free blocks first, then the oldest cached one"
    assert pool.lookup(hash_block(0, [1, 2]), 0, [1, 2]) is None, "an evicted block is forgotten"
    assert pool.lookup(hash_block(0, [3, 4]), 0, [3, 4]) == b
    pool.check_integrity([[d], [c], [a]])
    with pytest.raises(RuntimeError, match="only 1 available"):
        pool.allocate(2)


def test_share_takes_block_out_of_cache():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    pool.register(a, 7, 0, [1, 2])
    pool.release([a])
    pool.share(a)
    pool.share(a)
    pool.check_integrity([[a], [a]])
    assert pool.num_available == 1


def test_hit_is_verified_against_tokens():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    pool.register(a, 99, 5, [1, 2])
    assert pool.lookup(99, 5, [1, 2]) == a
    assert pool.lookup(99, 5, [2, 1]) is None, "a hash collision must not serve other tokens"
    assert pool.lookup(99, 6, [1, 2]) is None, "nor the same tokens computed after another prefix"


def test_hash_is_chained():
    assert hash_block(0, [1, 2]) != hash_block(hash_block(0, [0, 0]), [1, 2])


def test_integrity_catches_refcount_mismatch():
    pool = BlockPool(3, 2)
    a, _ = pool.allocate(2)
    with pytest.raises(AssertionError, match="refcounts"):
        pool.check_integrity([[a]])


def test_reset_prefix_cache():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    pool.register(a, 1, 0, [1, 2])
    pool.register(b, 2, 0, [3, 4])
    pool.release([a])
    pool.reset_prefix_cache()
    pool.check_integrity([[b]])
    assert pool.lookup(2, 0, [3, 4]) is None and len(pool.free) == 2


def test_integrity_catches_a_block_twice_in_one_table():
    pool = BlockPool(3, 2)
    (a,) = pool.allocate(1)
    pool.share(a)
    with pytest.raises(AssertionError, match="twice in one block table"):
        pool.check_integrity([[a, a]])

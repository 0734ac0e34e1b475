"""Block pool: refcounts, caching, eviction order, verified hits and the integrity check."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from workers.engine import block_pool
from workers.engine.block_pool import BlockKey, BlockPool, block_key, hash_block
from workers.engine.sequence import Group, Sequence


def test_allocate_release_cache_and_evict_oldest():
    pool = BlockPool(4, 2)
    a, b, c, d = pool.allocate(4)
    pool.register(a, block_key(0, [1, 2]))
    pool.register(b, block_key(0, [3, 4]))
    pool.release([a, b, c])
    pool.check_integrity([[d]])
    assert (len(pool.free), len(pool.cached), pool.num_available) == (1, 2, 3)
    assert pool.allocate(2) == [c, a], "free blocks first, then the oldest cached one"
    assert pool.lookup(block_key(0, [1, 2])) is None, "an evicted block is forgotten"
    assert pool.lookup(block_key(0, [3, 4])) == b
    pool.check_integrity([[d], [c], [a]])
    with pytest.raises(RuntimeError, match="only 1 available"):
        pool.allocate(2)


def test_share_takes_block_out_of_cache():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    pool.register(a, BlockKey(7, 0, (1, 2)))
    pool.release([a])
    pool.share(a)
    pool.share(a)
    pool.check_integrity([[a], [a]])
    assert pool.num_available == 1


def test_hit_is_verified_against_tokens():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    pool.register(a, BlockKey(99, 5, (1, 2)))
    assert pool.lookup(BlockKey(99, 5, (1, 2))) == a
    assert pool.lookup(BlockKey(99, 5, (2, 1))) is None, "a hash collision must not serve other tokens"
    assert pool.lookup(BlockKey(99, 6, (1, 2))) is None, "nor the same tokens computed after another prefix"


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(Group("r", 0, tokens, SamplingParams(), 0, 0, frozenset(), 64, 1), [0], list(tokens))


def computed(pool: BlockPool, seq: Sequence) -> Sequence:
    """`seq` with every token computed in fresh blocks past its cached prefix, its complete blocks registered."""
    pool.match_prefix(seq, 0)
    seq.block_table += pool.allocate(-(-len(seq.token_ids) // pool.block_size) - len(seq.block_table))
    seq.num_computed_tokens = len(seq.token_ids)
    pool.register_blocks(seq)
    return seq


def test_a_collision_further_up_the_chain_serves_nothing(monkeypatch):
    """A block hash that ignores the tokens' order: [4, 7] collides with [5, 6]. `late` completed [7, 8]
    after [5, 6] (its own [5, 6] a twin of `early`'s, computed in the same step); once `early`'s block is
    evicted, [4, 7] is registered in its place, and a prompt [4, 7, 7, 8] must not be served `late`'s [7, 8],
    whose KV was computed after [5, 6] (its hash and its parent's hash match, its prefix does not)."""
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, tokens: hash((parent, sum(tokens))))
    pool = BlockPool(8, 2)
    early, late = seq_of([5, 6, 1]), seq_of([5, 6, 7, 8, 1])
    for seq in (early, late):  # admitted together: both compute [5, 6]
        seq.block_table = pool.allocate(-(-len(seq.token_ids) // 2))
        seq.num_computed_tokens = len(seq.token_ids)
    for seq in (early, late):
        pool.register_blocks(seq)
    pool.release(reversed(early.block_table))
    pool.release(pool.allocate(len(pool.free) + 1))  # early's [5, 6] is evicted
    other = computed(pool, seq_of([4, 7, 1]))
    mixed, again = seq_of([4, 7, 7, 8, 1]), seq_of([5, 6, 7, 8, 1])
    assert pool.match_prefix(mixed, 0) == 2, "only [4, 7] is served"
    assert pool.match_prefix(again, 0) == 0, "[5, 6] is gone, so is what followed it"
    pool.check_integrity([late.block_table, other.block_table, mixed.block_table])


def test_a_twin_takes_the_registered_key():
    """A block computed twice (two prompts admitted together) keeps one key, so later chains share it."""
    pool = BlockPool(8, 2)
    a, b = seq_of([5, 6, 1]), seq_of([5, 6, 7, 8, 1])
    for seq in (a, b):
        seq.block_table = pool.allocate(-(-len(seq.token_ids) // 2))
        seq.num_computed_tokens = len(seq.token_ids)
        pool.register_blocks(seq)
    assert b.block_hashes[0] is a.block_hashes[0] and b.block_hashes[1].parent is a.block_hashes[0]
    c = computed(pool, seq_of([5, 6, 7, 8, 9, 1]))
    assert c.block_table[:2] == [a.block_table[0], b.block_table[1]] and c.num_computed_tokens == 6


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
    pool.register(a, BlockKey(1, 0, (1, 2)))
    pool.register(b, BlockKey(2, 0, (3, 4)))
    pool.release([a])
    pool.reset_prefix_cache()
    pool.check_integrity([[b]])
    assert pool.lookup(BlockKey(2, 0, (3, 4))) is None and len(pool.free) == 2


def test_integrity_catches_a_block_twice_in_one_table():
    pool = BlockPool(3, 2)
    (a,) = pool.allocate(1)
    pool.share(a)
    with pytest.raises(AssertionError, match="twice in one block table"):
        pool.check_integrity([[a, a]])

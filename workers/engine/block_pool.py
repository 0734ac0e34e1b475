"""Fixed-size KV blocks with refcounts and a chained-hash prefix cache."""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from typing import Iterable

import xxhash

from workers.engine.sequence import Sequence

_M64 = (1 << 64) - 1


def hash_block(parent: int, token_ids: list[int]) -> int:
    """Chained 128-bit hash of one complete block: its tokens (int64) after the hash of the block before it
    (128 bits: across the billions of blocks of a long run, 64 would leave a collision within reach)."""
    return xxhash.xxh3_128_intdigest(struct.pack(f"<QQ{len(token_ids)}q", parent & _M64, parent >> 64, *token_ids))


def prompt_hash(token_ids: list[int]) -> int:
    """A 64-bit hash of a prompt's token ids, which keys its samples' noise."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(token_ids)}q", 0, *token_ids))


def parent_hash(seq: Sequence, i: int) -> int:
    """The hash block `i` of `seq` chains from: its previous block's, or the sequence's root."""
    return seq.block_hashes[i - 1] if i else seq.hash_root


class BlockPool:
    """Hands out KV blocks. A block is used (refcount > 0), cached (free but holding hashed KV that a
    later prompt may reuse; evicted oldest first) or free."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.contents: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (parent hash, tokens)
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_available(self) -> int:
        """Blocks that `allocate` can hand out now (free plus evictable cached)."""
        return len(self.free) + len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks with refcount 1; evicts the oldest cached blocks when no free one is left."""
        if n > self.num_available:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_available} available")
        blocks = []
        for _ in range(n):
            block = self.free.popleft() if self.free else self._evict_oldest()
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict_oldest(self) -> int:
        block, _ = self.cached.popitem(last=False)
        self._unhash(block)
        return block

    def _unhash(self, block: int) -> None:
        if self.hash_to_block.get(self.hashes[block]) == block:
            del self.hash_to_block[self.hashes[block]]
        self.hashes[block] = None
        self.contents[block] = None

    def share(self, block: int) -> None:
        """One more owner of `block` (a forked child, or a prompt that hit the prefix cache)."""
        if self.ref_counts[block] == 0:
            del self.cached[block]
        self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one owner of each block; unowned hashed blocks stay cached, others become free."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hashes[block] is None:
                    self.free.append(block)
                else:
                    self.cached[block] = None

    def lookup(self, block_hash: int, parent: int, token_ids: list[int]) -> int | None:
        """The block holding exactly these tokens after the block hashed `parent`, if the cache has it: a hit
        is verified against both, so a colliding hash never serves KV computed after another prefix."""
        block = self.hash_to_block.get(block_hash)
        if block is None or self.contents[block] != (parent, tuple(token_ids)):
            return None
        return block

    def register(self, block: int, block_hash: int, parent: int, token_ids: list[int]) -> None:
        """Mark a complete, computed block as reusable by later prompts with the same prefix."""
        if block_hash in self.hash_to_block or self.hashes[block] is not None:
            return
        self.hashes[block] = block_hash
        self.contents[block] = (parent, tuple(token_ids))
        self.hash_to_block[block_hash] = block

    def match_prefix(self, seq: Sequence, root: int) -> int:
        """Share the cached complete blocks that start `seq` (its chain rooted in `root`, the weights
        version); at least one token stays to compute. Returns the number of tokens served."""
        parent, bs = root, self.block_size
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = seq.block_tokens(i, bs)
            block_hash = hash_block(parent, tokens)
            block = self.lookup(block_hash, parent, tokens)
            if block is None:
                break
            self.share(block)
            seq.block_table.append(block)
            seq.block_hashes.append(block_hash)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def register_blocks(self, seq: Sequence) -> None:
        """Hash the blocks `seq` has completed since the last call so later prompts can reuse them."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed_tokens:
            i = len(seq.block_hashes)
            tokens, parent = seq.block_tokens(i, bs), parent_hash(seq, i)
            seq.block_hashes.append(hash_block(parent, tokens))
            self.register(seq.block_table[i], seq.block_hashes[i], parent, tokens)

    def find(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding block `i` of `seq` (by its recorded hash), if any."""
        if i >= len(seq.block_hashes):
            return None
        return self.lookup(seq.block_hashes[i], parent_hash(seq, i), seq.block_tokens(i, self.block_size))

    def register_found(self, seq: Sequence, i: int, block: int) -> None:
        """Register `block`, just filled with block `i` of `seq` (a restore), under its recorded hash."""
        if i < len(seq.block_hashes):
            self.register(block, seq.block_hashes[i], parent_hash(seq, i), seq.block_tokens(i, self.block_size))

    def reset_prefix_cache(self) -> None:
        """Forget every hash: cached blocks become free, used blocks are never matched again."""
        for block in list(self.hash_to_block.values()):
            self._unhash(block)
        self.free.extend(self.cached)
        self.cached.clear()

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Prove free + used + cached == total and that refcounts equal the owners in block tables."""
        owners = [0] * self.num_blocks
        for table in block_tables:
            assert len(set(table)) == len(table), f"a block is twice in one block table: {table}"
            for block in table:
                owners[block] += 1
        used = sum(1 for c in self.ref_counts if c > 0)
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached"
        assert len(free) + len(cached) + used == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + used {used} != total {self.num_blocks}")
        assert owners == self.ref_counts, "refcounts do not match block tables"
        assert all(self.ref_counts[b] == 0 for b in free | cached), "a free or cached block has owners"
        assert all(self.hashes[b] is not None for b in cached), "a cached block has no hash"
        assert all(self.hashes[b] == h for h, b in self.hash_to_block.items()), "hash table out of sync"

"""Fixed-size KV blocks with refcounts and a chained-hash prefix cache."""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from typing import Iterable, NamedTuple, Union

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


class BlockKey(NamedTuple):
    """What a complete block holds: its chained hash, the key of the block before it (or, for a first block,
    the int root of its chain: hash_roots.py) and its tokens. Never hashed or compared as a tuple: the
    prefix cache finds a block by `hash` and verifies it with `same_prefix`."""

    hash: int
    parent: Union["BlockKey", int]
    tokens: tuple[int, ...]


def block_key(parent: BlockKey | int, token_ids: list[int]) -> BlockKey:
    """The key of a block holding `token_ids` after the block keyed `parent` (or first under root `parent`)."""
    parent_hash = parent.hash if isinstance(parent, BlockKey) else parent
    return BlockKey(hash_block(parent_hash, token_ids), parent, tuple(token_ids))


def same_prefix(a: BlockKey | int, b: BlockKey | int) -> bool:
    """Whether `a` and `b` are the same tokens after the same root, every block back to it (or to a key they
    share) compared: a hash collision at any block of the chain is caught. A loop, not a recursion: chains run
    thousands of blocks deep."""
    while a is not b:
        if not (isinstance(a, BlockKey) and isinstance(b, BlockKey)):
            return a == b
        if a.hash != b.hash or a.tokens != b.tokens:
            return False
        a, b = a.parent, b.parent
    return True


def parent_key(seq: Sequence, i: int) -> BlockKey | int:
    """The key block `i` of `seq` chains from: its previous block's, or the sequence's root."""
    return seq.block_hashes[i - 1] if i else seq.hash_root


class BlockPool:
    """Hands out KV blocks. A block is used (refcount > 0), cached (free but holding hashed KV that a
    later prompt may reuse; evicted oldest first) or free."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.keys: list[BlockKey | None] = [None] * num_blocks  # of the registered (hashed) blocks
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
        del self.hash_to_block[self.keys[block].hash]
        self.keys[block] = None

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
                if self.keys[block] is None:
                    self.free.append(block)
                else:
                    self.cached[block] = None

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding exactly `key`'s tokens after exactly its prefix, if the cache has it: a hit is
        verified back to the root, so a colliding hash never serves KV computed after another prefix."""
        block = self.hash_to_block.get(key.hash)
        if block is None or not same_prefix(self.keys[block], key):
            return None
        return block

    def register(self, block: int, key: BlockKey) -> None:
        """Mark a complete, computed block as reusable by later prompts with the same prefix."""
        if key.hash in self.hash_to_block or self.keys[block] is not None:
            return
        self.keys[block] = key
        self.hash_to_block[key.hash] = block

    def match_prefix(self, seq: Sequence, root: int) -> int:
        """Share the cached complete blocks that start `seq` (its chain rooted in `root`, the weights
        version); at least one token stays to compute. Returns the number of tokens served."""
        parent: BlockKey | int = root
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            block = self.lookup(block_key(parent, seq.block_tokens(i, self.block_size)))
            if block is None:
                break
            self.share(block)
            seq.block_table.append(block)
            parent = self.keys[block]
            seq.block_hashes.append(parent)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def register_blocks(self, seq: Sequence) -> None:
        """Key the blocks `seq` has completed since the last call so later prompts can reuse them. A block
        whose twin is registered already takes the twin's key, so that chains share keys and verify fast."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed_tokens:
            i = len(seq.block_hashes)
            key = block_key(parent_key(seq, i), seq.block_tokens(i, bs))
            twin = self.hash_to_block.get(key.hash)
            if twin is None:
                self.register(seq.block_table[i], key)
            elif same_prefix(self.keys[twin], key):
                key = self.keys[twin]
            seq.block_hashes.append(key)

    def find(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding block `i` of `seq` (by its recorded key), if any."""
        return self.lookup(seq.block_hashes[i]) if i < len(seq.block_hashes) else None

    def register_found(self, seq: Sequence, i: int, block: int) -> None:
        """Register `block`, just filled with block `i` of `seq` (a restore), under its recorded key."""
        if i < len(seq.block_hashes):
            self.register(block, seq.block_hashes[i])

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
        assert all(self.keys[b] is not None for b in cached), "a cached block has no hash"
        assert all(self.keys[b].hash == h for h, b in self.hash_to_block.items()), "hash table out of sync"
        assert sum(k is not None for k in self.keys) == len(self.hash_to_block), "a keyed block is not in the table"

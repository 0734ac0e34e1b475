"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollout.config import EngineConfig
from workers.engine.block_pool import BlockPool, hash_block
from workers.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one step computes: `num_tokens[i]` new tokens of `seqs[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    """Owns the waiting queue and the running list, and every block a sequence holds."""

    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fork_blocks: dict[int, list[int]] = {}
        self.cached_prefix_tokens = 0

    @property
    def num_running_samples(self) -> int:
        return sum(len(seq.sample_indices) for seq in self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Decode tokens first, then prefill chunks of running and then waiting sequences."""
        batch, budget = Batch(), self.config.max_batch_tokens
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if budget and self._grow(seq, 1):
                batch.add(seq, 1)
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed > 1]:
            budget -= self._schedule_prefill(batch, seq, budget)
        while self.waiting and budget and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            cached = self._match_prefix(seq)
            used = self._schedule_prefill(batch, seq, budget)
            if not used:
                self._release(seq)
                break
            budget -= used
            self.cached_prefix_tokens += cached
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
        return batch

    def _fits(self, seq: Sequence) -> bool:
        return self.num_running_samples + len(seq.sample_indices) <= self.config.max_num_seqs

    def _schedule_prefill(self, batch: Batch, seq: Sequence, budget: int) -> int:
        """Add the next chunk of `seq` if its blocks can be had; returns the tokens used."""
        n = min(seq.num_uncomputed, budget)
        completes = n == seq.num_uncomputed
        partial = len(seq.token_ids) % self.block_size != 0
        extra = len(seq.sample_indices) - 1 if completes and partial else 0
        if n == 0 or not self._grow(seq, n, extra):
            return 0
        batch.add(seq, n)
        return n

    def _grow(self, seq: Sequence, n: int, extra: int = 0) -> bool:
        """Give `seq` blocks for `n` more tokens (plus `extra` for its fork), or nothing at all."""
        total = seq.num_computed_tokens + n
        need = -(-total // self.block_size) - len(seq.block_table)
        if max(need, 0) + extra > self.pool.num_available:
            return False
        seq.block_table += self.pool.allocate(max(need, 0))
        if extra:
            self.fork_blocks[id(seq)] = self.pool.allocate(extra)
        return True

    def _match_prefix(self, seq: Sequence) -> int:
        """Share the cached complete blocks that start this prompt; at least one token stays to compute.
        Returns the number of tokens served from the cache."""
        if not self.config.enable_prefix_caching:
            return 0
        bs, parent = self.block_size, 0
        for i in range((len(seq.token_ids) - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            parent = hash_block(parent, tokens)
            block = self.pool.lookup(parent, tokens)
            if block is None:
                break
            self.pool.share(block)
            seq.block_table.append(block)
            seq.block_hashes.append(parent)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def _release(self, seq: Sequence) -> None:
        """Give back every block of `seq` and forget what was computed."""
        self.pool.release(reversed(seq.block_table))
        self.pool.release(self.fork_blocks.pop(id(seq), []))
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def register_blocks(self, seq: Sequence) -> None:
        """Hash the blocks `seq` has completed since the last step so later prompts can reuse them."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed_tokens:
            i = len(seq.block_hashes)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            block_hash = hash_block(seq.block_hashes[-1] if i else 0, tokens)
            self.pool.register(seq.block_table[i], block_hash, tokens)
            seq.block_hashes.append(block_hash)

    def fork(self, seq: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """New children share the parent's complete blocks and each get a copy of its partial last
        block (the parent keeps the original); returns the (src, dst) block copies to make."""
        copies = []
        spare = self.fork_blocks.pop(id(seq), [])
        num_full = len(seq.block_table) - (1 if spare else 0)
        for child in children:
            full = child.block_table[:num_full]
            for block in full:
                self.pool.share(block)
            if spare:
                dst = spare.pop()
                copies.append((child.block_table[-1], dst))
                child.block_table = full + [dst]
        self.running.extend(children)
        return copies

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def block_tables(self) -> list[list[int]]:
        """Every block owner, for `BlockPool.check_integrity`."""
        return [s.block_table for s in [*self.running, *self.waiting]] + list(self.fork_blocks.values())

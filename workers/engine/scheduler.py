"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks.

When blocks run short, the newest running requests are preempted, enough at once that every
remaining decode gets its block: offloaded to the CPU pool when it has room, otherwise reset for
recompute. Offloaded requests are restored before any new prompt is admitted. Running sequences keep
their requests' order of arrival, a restored or recomputing one in its place, so that the oldest always
make progress (appended last, a context being recomputed was the next victim, before it made a token).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections import deque
from typing import Callable, Iterator

from rollout.config import EngineConfig
from workers.engine.batch import Batch
from workers.engine.block_pool import BlockPool
from workers.engine.block_table import BlockTables
from workers.engine.hash_roots import HashRoots
from workers.engine.offload import CpuPool
from workers.engine.preemption import Offloader
from workers.engine.seq_blocks import blocks_needed, fork_spare_blocks, growing_decodes, share_blocks
from workers.engine.sequence import Sequence, Status

TOKEN_COUNTERS = ("prefill_tokens", "decode_tokens", "recomputed_tokens", "wasted_tokens")


class Scheduler:
    """Owns the waiting, running and offloaded queues, and every block a sequence holds."""

    def __init__(self, config: EngineConfig, pool: BlockPool, tables: BlockTables,
                 cpu_pool: CpuPool | None = None, rope_switch_length: int | None = None,
                 max_chunk: int | None = None) -> None:
        self.config = config
        self.max_chunk = max_chunk or config.max_batch_tokens  # prompt tokens one sequence computes per step
        self.pool = pool
        self.tables = tables
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest request first (`_age`)
        self.arrivals = itertools.count()
        self.offloader = Offloader(pool, tables, cpu_pool)
        self.counters = dict.fromkeys(("cached_prefix_tokens", "recomputes", *TOKEN_COUNTERS), 0)
        self.roots = HashRoots(rope_switch_length)
        self.admit_new = True
        # called before any preemption; the engine collects the step in flight there (async batching), so
        # that a sample it stopped ends and frees its blocks instead of being preempted; True if there was one
        self.before_preempt: Callable[[], bool] = lambda: False

    @property
    def num_running_samples(self) -> int:
        """Samples the running sequences stand for (an unforked prompt counts its n)."""
        return sum(len(seq.sample_indices) for seq in self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones."""
        seq.arrival = next(self.arrivals)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits, runs or is offloaded."""
        return bool(self.waiting or self.running or self.offloader.offloaded)

    def restart_prefills(self) -> None:
        """Drop the KV of every prompt still in prefill, and of every sample still recomputing its context after
        a preemption, each keeping its place first in line: before a weights update, so that no context is
        computed partly under the old weights and partly under the new."""
        for seq in reversed([s for s in self.running if not s.started or s.num_uncomputed > 1]):
            self.running.remove(seq)
            self._requeue(seq)

    @contextlib.contextmanager
    def started_only(self) -> Iterator[None]:
        """Admit no new request while inside (a drain finishes what is started); started ones wait first."""
        self.waiting = deque(sorted(self.waiting, key=lambda s: not s.started))
        self.admit_new = False
        try:
            yield
        finally:
            self.admit_new = True

    def schedule(self) -> Batch:
        """Decode tokens first, then prefill chunks of running and then waiting sequences."""
        batch, budget = Batch(), self.config.max_batch_tokens
        self._recompute_rope_switches()
        decodes, prefills = self._split_running()
        decodes = decodes[:budget]
        growing = growing_decodes(decodes, self.block_size)
        if self._make_room(batch, decodes, growing):
            prefills = self._split_running()[1]
        else:
            restored = self._restore(batch, len(growing))[: budget - len(decodes)]
            decodes += restored
            growing += growing_decodes(restored, self.block_size)
        for seq, block in zip(growing, self.pool.allocate(len(growing))):
            seq.block_table.append(block)
        batch.seqs, batch.num_tokens, batch.num_decodes = decodes, [1] * len(decodes), len(decodes)
        budget -= len(decodes)
        while True:
            for seq in prefills:
                budget -= self._schedule_prefill(batch, seq, budget, partial=True)
            if not self.offloader.offloaded:
                budget -= self._admit(batch, budget)
            if batch.seqs or not self.running:
                return batch
            if not self.before_preempt():
                self._preempt(self.running[-1], batch)
            prefills = self._split_running()[1]

    def _split_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode one token (samples with one token left: a prompt's last
        token goes through prefill, which reserves the blocks of its fork), and those with prompt (or
        recompute) tokens left."""
        decodes, prefills = [], []
        for seq in self.running:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left == 1 and len(seq.sample_indices) == 1:
                decodes.append(seq)
            elif left:
                prefills.append(seq)
        return decodes, prefills

    def update(self, batch: Batch) -> int:
        """After the launch: count the computed tokens (a sample's last token is a decode, also at the end of
        a recompute; other tokens are prompt prefill, or recompute after a preemption) and register completed
        blocks.
        Returns the tokens wasted: those of sequences that finished meanwhile (a stop token of the step
        before, collected after this one was launched)."""
        counters, bs, decodes, wasted, finished = self.counters, self.block_size, 0, 0, Status.FINISHED
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.status is finished:
                wasted += n
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            length = len(seq.token_ids)
            if computed == length and length > seq.num_prompt_tokens:  # its last sampled token: computed anew
                decodes, n = decodes + 1, n - 1
            if n:
                counters["recomputed_tokens" if seq.num_preemptions else "prefill_tokens"] += n
            if computed >= (len(seq.block_hashes) + 1) * bs:
                self.pool.register_blocks(seq)
        counters["decode_tokens"] += decodes
        counters["wasted_tokens"] += wasted
        return wasted

    def _recompute_rope_switches(self) -> None:
        """Reset (as a preemption) the running sequences whose last token took them past the LongRoPE switch."""
        if self.roots.rope_switch_length is None:  # every step: not a call per running sequence for other models
            return
        for seq in [s for s in self.running if self.roots.crossed_switch(s)]:
            self.running.remove(seq)
            seq.num_preemptions += 1
            self._reset(seq)

    def _make_room(self, batch: Batch, decodes: list[Sequence], growing: list[Sequence]) -> bool:
        """Preempt the newest running sequences until every decode that needs a block this step
        (`growing`) gets one; victims leave both lists. True when anything was preempted."""
        preempted = False
        while len(growing) > self.pool.num_available:
            if self.before_preempt():
                decodes[:] = [seq for seq in decodes if seq.status is not Status.FINISHED]
                growing[:] = [seq for seq in growing if seq.status is not Status.FINISHED]
                continue
            victim = self.running[-1]
            if victim in growing:
                growing.remove(victim)
            if victim in decodes:
                decodes.remove(victim)
            self._preempt(victim, batch)
            preempted = True
        return preempted

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        if self.offloader.offload(seq, batch):
            return
        self._reset(seq)

    def _reset(self, seq: Sequence) -> None:
        """Drop the KV of `seq`; it waits first in line and is recomputed (through the prefix cache)."""
        self._requeue(seq)
        self.counters["recomputes"] += 1

    def _requeue(self, seq: Sequence) -> None:
        """Give back every block of `seq`; it waits first in line, to be computed again."""
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _restore(self, batch: Batch, growing: int) -> list[Sequence]:
        """Bring offloaded sequences back while they fit beside the `growing` decodes that take a block
        this step; one whose KV is gone from the CPU and the device is recomputed instead."""
        room = self.config.max_num_seqs - self.num_running_samples
        restored, lost = self.offloader.restore_fitting(batch, self.pool.num_available - growing, room)
        for seq in lost:
            self._reset(seq)
        self._run(restored)
        return restored

    def _admit(self, batch: Batch, budget: int) -> int:
        """Start waiting sequences in order while budget, blocks and `max_num_seqs` allow."""
        used = 0
        while self.waiting and budget > used and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            if not (self.admit_new or seq.started):
                break
            self.roots.assign(seq)
            cached = self.pool.match_prefix(seq, seq.hash_root) if self.config.enable_prefix_caching else 0
            n = self._schedule_prefill(batch, seq, budget - used)
            if not n:
                self._release(seq)
                break
            used += n
            self.counters["cached_prefix_tokens"] += cached
            seq.status = Status.RUNNING
            self._run([self.waiting.popleft()])
        return used

    def _fits(self, seq: Sequence) -> bool:
        return self.num_running_samples + len(seq.sample_indices) <= self.config.max_num_seqs

    def _schedule_prefill(self, batch: Batch, seq: Sequence, budget: int, partial: bool = False) -> int:
        """Add the next chunk of `seq` if its blocks (and, with its last chunk, its fork's) can be
        had; with `partial` (a running prompt, which newer ones must not hold back for good) a chunk
        short of blocks shrinks to the blocks there are, short of the last one. Returns the tokens used."""
        n = min(seq.num_uncomputed, budget, self.max_chunk)
        if n == 0:
            return 0
        spare = fork_spare_blocks(len(seq.token_ids), len(seq.sample_indices), self.block_size)
        if n < seq.num_uncomputed:
            spare = 0
        if blocks_needed(seq, n, self.block_size) + spare > self.pool.num_available:
            if not partial:
                return 0
            fit = (len(seq.block_table) + self.pool.num_available) * self.block_size - seq.num_computed_tokens
            n, spare = min(n, fit, seq.num_uncomputed - 1), 0
            if n <= 0:
                return 0
        need = blocks_needed(seq, n, self.block_size)
        seq.block_table += self.pool.allocate(need)
        seq.fork_blocks = self.pool.allocate(spare)
        batch.add(seq, n)
        return n

    def _release(self, seq: Sequence) -> None:
        """Give back every block of `seq` and its block-table row, and forget what was computed."""
        self.pool.release(reversed(seq.block_table))
        self.pool.release(seq.fork_blocks)
        self.tables.release(seq)
        seq.block_table, seq.block_hashes, seq.fork_blocks, seq.num_computed_tokens = [], [], [], 0

    def fork(self, seq: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """Run a prompt's new children beside it, sharing its blocks (`share_blocks`); returns the (src, dst)
        block copies to make."""
        copies = share_blocks(self.pool, seq, children)
        self._run(children)
        return copies

    def _run(self, seqs: list[Sequence]) -> None:
        """Add `seqs` to the running ones, each in its request's place by arrival."""
        for seq in seqs:
            bisect.insort(self.running, seq, key=_age)

    def finish(self, seqs: list[Sequence]) -> None:
        """Free finished or aborted sequences' blocks, wherever they are: one pass over the running ones, and
        over the others only if some are not running (one pass per sequence took seconds to abort a call of
        thousands of queued prompts)."""
        if not seqs:
            return
        gone, running = {id(seq) for seq in seqs}, len(self.running)
        self.running[:] = [seq for seq in self.running if id(seq) not in gone]
        if running - len(self.running) < len(gone):
            self.waiting = deque(seq for seq in self.waiting if id(seq) not in gone)
            for seq in [seq for seq in self.offloader.offloaded if id(seq) in gone]:
                self.offloader.drop(seq)
        for seq in seqs:
            seq.status = Status.FINISHED
            self._release(seq)

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence: running, waiting and offloaded."""
        return [*self.running, *self.waiting, *self.offloader.offloaded]

    def stats(self) -> dict[str, int]:
        """Token and preemption counters since start, and the queues' current sizes."""
        return {**self.counters, "offloads": self.offloader.offloads, "restores": self.offloader.restores,
                "running": len(self.running), "waiting": len(self.waiting),
                "offloaded": len(self.offloader.offloaded)}

    def check_integrity(self) -> None:
        """Block accounting balances (the CPU pool's too), every block a sequence will still write is its
        alone, and the block tables hold exactly each sequence's blocks."""
        seqs = self.sequences()
        self.pool.check_integrity([s.block_table for s in seqs] + [s.fork_blocks for s in seqs])
        for seq in seqs:
            for block in seq.block_table[seq.num_computed_tokens // self.block_size:]:
                assert self.pool.ref_counts[block] == 1, f"block {block} is shared but still written"
        self.tables.check(seqs)
        self.offloader.check()


def _age(seq: Sequence) -> tuple[int, int]:
    """A running sequence's place: its request's arrival, then its sample index."""
    return seq.arrival, seq.sample_indices[0]

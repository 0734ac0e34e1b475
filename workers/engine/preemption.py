"""Preempted sequences: offload their KV to the CPU pool and restore it, or drop it for recompute."""

from __future__ import annotations

from collections import deque

from workers.engine.batch import Batch
from workers.engine.block_pool import BlockPool
from workers.engine.block_table import BlockTables
from workers.engine.offload import CpuPool
from workers.engine.sequence import Sequence, Status, cdiv


class Offloader:
    """Moves decoding sequences between the device blocks and the CPU pool.

    A sequence's exclusive blocks (and any it shares that the prefix cache could not find again) are
    copied out; blocks it shares through the prefix cache are only released and found again by hash
    on restore, where copied complete blocks are also matched by hash so identical KV is kept once.
    """

    def __init__(self, pool: BlockPool, tables: BlockTables, cpu_pool: CpuPool | None) -> None:
        self.pool = pool
        self.cpu_pool = cpu_pool
        self.tables = tables
        self.offloaded: deque[Sequence] = deque()
        self.offloads = self.restores = 0

    def offload(self, seq: Sequence, batch: Batch) -> bool:
        """Copy `seq` to the CPU pool and free its device blocks; False when it can't go there."""
        if self.cpu_pool is None or not seq.is_forked or seq.num_uncomputed != 1:
            return False
        copy = [self.pool.ref_counts[b] == 1 or self.pool.keys[b] is None for b in seq.block_table]
        if sum(copy) > self.cpu_pool.num_free or not self._offload_state(seq, batch):
            return False
        cpu = iter(self.cpu_pool.allocate(sum(copy)))
        slots = [next(cpu) if c else -1 for c in copy]
        batch.offload_copies += [(b, c) for b, c in zip(seq.block_table, slots) if c >= 0]
        self.pool.release(reversed(seq.block_table))
        self.tables.release(seq)
        seq.block_table = []
        seq.cpu_blocks = slots
        self.offloaded.append(seq)
        self.offloads += 1
        return True

    def _offload_state(self, seq: Sequence, batch: Batch) -> bool:
        """Queue the copy of `seq`'s recurrent state out of its row, when the model has one; False when no
        state slot is free."""
        if self.cpu_pool.states is None:
            return True
        slot = self.cpu_pool.take_state()
        if slot is None:
            return False
        seq.cpu_state = slot
        batch.state_offloads.append((seq.row, slot))
        return True

    def plan_restore(self, seq: Sequence) -> tuple[list[int | None], int] | None:
        """Per block: the device block to share (or None to copy in); and the device blocks the
        restore consumes, with the one its next token needs. None when a block that was not copied
        is gone from the device."""
        plan, consumed = [], 0
        for i, slot in enumerate(seq.cpu_blocks):
            found = self.pool.find(seq, i)
            if found is None and slot < 0:
                return None
            plan.append(found)
            consumed += found is None or self.pool.ref_counts[found] == 0
        return plan, consumed + cdiv(len(seq.token_ids), self.pool.block_size) - len(plan)

    def restore_fitting(self, batch: Batch, spare: int, room: int) -> tuple[list[Sequence], list[Sequence]]:
        """Restore offloaded sequences, oldest first, while their blocks fit in `spare` device blocks and
        they in `room` running samples. Returns those restored, and those dropped because a block that was
        not copied is gone from the device (to recompute)."""
        restored, lost = [], []
        while self.offloaded and len(restored) < room:
            seq = self.offloaded[0]
            plan = self.plan_restore(seq)
            if plan is None:
                self.drop(seq)
                lost.append(seq)
                continue
            blocks, consumed = plan
            if consumed > spare:
                break
            self.offloaded.popleft()
            self.restore(seq, blocks, batch)
            restored.append(seq)
            spare -= consumed
        return restored, lost

    def restore(self, seq: Sequence, plan: list[int | None], batch: Batch) -> None:
        """Bring `seq` back onto the device following `plan`. Its CPU blocks are free again at once:
        nothing is offloaded in a step that restores, so no offload can overwrite them first."""
        slots, seq.cpu_blocks = seq.cpu_blocks, []
        for found in plan:
            if found is not None:
                self.pool.share(found)  # before allocating, which could evict it from the cache
        fresh = iter(self.pool.allocate(plan.count(None)))
        for i, (found, slot) in enumerate(zip(plan, slots)):
            if found is None:
                found = next(fresh)
                batch.restore_copies.append((slot, found))
                self.pool.register_found(seq, i, found)
            seq.block_table.append(found)
        self.cpu_pool.release([s for s in slots if s >= 0])
        if seq.cpu_state >= 0:
            batch.state_restores.append((seq.cpu_state, seq))
            self.cpu_pool.release_state(seq.cpu_state)
            seq.cpu_state = -1
        seq.status = Status.RUNNING
        self.restores += 1

    def check(self) -> None:
        """Every CPU block and state slot is free or held by exactly one offloaded sequence."""
        if self.cpu_pool is None:
            return
        pool = self.cpu_pool
        blocks = [b for seq in self.offloaded for b in seq.cpu_blocks if b >= 0] + list(pool.free)
        assert sorted(blocks) == list(range(pool.num_blocks)), "a CPU block leaked or is held twice"
        states = [seq.cpu_state for seq in self.offloaded if seq.cpu_state >= 0] + list(pool.free_states)
        assert sorted(states) == list(range(pool.num_states)), "a CPU state slot leaked or is held twice"

    def drop(self, seq: Sequence) -> None:
        """Forget an offloaded copy (its sequence will be recomputed, or was aborted)."""
        self.cpu_pool.release([s for s in seq.cpu_blocks if s >= 0])
        if seq.cpu_state >= 0:
            self.cpu_pool.release_state(seq.cpu_state)
        seq.cpu_blocks, seq.cpu_state = [], -1
        self.offloaded.remove(seq)

"""The persistent block table: one row per running sequence, changed only when its blocks change."""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.sequence import Sequence


class BlockTables:
    """`[max_num_seqs, max_blocks_per_seq]` int32 block ids, kept on the host.

    A sequence takes a row when it first runs in a step and gives it back when it loses its blocks
    (preempted, offloaded, finished). Between those, its blocks only grow, so `sync` writes only the
    new tail of the rows whose sequence gained blocks, and records the changed cells; the model runner
    applies them to its device copy. Cells past a sequence's own blocks keep old ids and are never
    read: every kernel stops at `seq_lens`.
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.host = torch.zeros((max_rows, max_blocks), dtype=torch.int32)
        self.array = self.host.numpy()
        self.written = np.zeros(max_rows, np.int64)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.changed: list[np.ndarray] = []

    @property
    def max_blocks(self) -> int:
        """Columns of the table: blocks of a `max_model_len` sequence."""
        return self.array.shape[1]

    def sync(self, seqs: list[Sequence]) -> tuple[np.ndarray, int, list[Sequence]]:
        """The rows of `seqs`, a free one taken on a sequence's first step, with new blocks written in;
        also the widest of those rows and the sequences that took their row now."""
        lengths = np.array([len(seq.block_table) for seq in seqs], np.int64)
        rows = np.array([seq.row for seq in seqs], np.int64)
        stale = np.flatnonzero((rows < 0) | (self.written[rows] != lengths))
        stale_seqs = [seqs[i] for i in stale.tolist()]
        new = [seq for seq in stale_seqs if seq.row < 0]
        if len(new) > len(self.free_rows):
            raise RuntimeError("no free block-table row: more running sequences than max_num_seqs")
        for seq in new:
            seq.row = self.free_rows.pop()
        if stale_seqs:
            rows[stale] = [seq.row for seq in stale_seqs]
            self._write(stale_seqs, rows[stale], lengths[stale])
        return rows, int(lengths.max()), new

    def _write(self, seqs: list[Sequence], rows: np.ndarray, lengths: np.ndarray) -> None:
        """Write the blocks of `seqs` (at their `rows`) past what those rows hold, in one assignment."""
        starts = self.written[rows]
        counts = lengths - starts
        offsets = np.cumsum(counts) - counts
        cells = np.repeat(rows * self.max_blocks + starts - offsets, counts) + np.arange(counts.sum())
        self.array.reshape(-1)[cells] = [b for seq, a in zip(seqs, starts.tolist()) for b in seq.block_table[a:]]
        self.written[rows] = lengths
        self.changed.append(cells)

    def release(self, seq: Sequence) -> None:
        """Give the row of `seq` back (it no longer holds blocks)."""
        if seq.row >= 0:
            self.written[seq.row] = 0
            self.free_rows.append(seq.row)
            seq.row = -1

    def take_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat cell indices written since the last call, and their block ids."""
        cells = np.concatenate(self.changed) if self.changed else np.zeros(0, np.int64)
        self.changed = []
        return cells, self.array.reshape(-1)[cells]

    def check(self, seqs: list[Sequence]) -> None:
        """Every sequence with a row has exactly its own blocks there, and no two share a row."""
        rows = [s.row for s in seqs if s.row >= 0]
        assert len(set(rows)) == len(rows), "two sequences share a block-table row"
        assert not set(rows) & set(self.free_rows), "a block-table row is both free and used"
        for seq in seqs:
            if seq.row >= 0:
                n = len(seq.block_table)
                assert self.written[seq.row] == n, f"row {seq.row} holds {self.written[seq.row]} of {n} blocks"
                assert self.array[seq.row, :n].tolist() == seq.block_table, f"row {seq.row} is stale"

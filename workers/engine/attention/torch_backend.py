"""The reference paged attention in plain torch: vectorised per group of sequences, CPU and tests."""

from __future__ import annotations

import torch

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.kv_cache import KvCache
from workers.engine.sequence import cdiv


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k `[T, Hkv, D]` and v `[T, Hkv, Dv]` (Dv <= D: into the first Dv of each value's D) into caches
    `[num_blocks, block_size, Hkv, D]` at `slot_mapping`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:])[..., :v.shape[-1]].index_copy_(0, slots, v[keep])


class _Group:
    """Sequences padded to one [rows, max_q] x [rows, num_blocks * block_size] problem, with masks.

    `q_pos[r, i]` is the position of query `i` of row `r`; row `r` sees its first `k_lens[r]` keys,
    gathered from `blocks[r]` (from `ring_blocks[r]` in a layer that keeps only its window). Subclasses say
    how queries are gathered from, and written back to, the packed tokens.
    """

    def __init__(self, blocks: torch.Tensor, ring_blocks: torch.Tensor | None, q_pos: torch.Tensor,
                 k_lens: torch.Tensor, block_size: int) -> None:
        self.blocks = blocks
        self.ring_blocks = ring_blocks
        self.q_pos = q_pos
        self.k_pos = torch.arange(blocks.shape[1] * block_size, device=blocks.device)[None, None, :]
        self.causal = (self.k_pos <= q_pos[:, :, None]) & (self.k_pos < k_lens[:, None, None])
        self.masks: dict[int | None, torch.Tensor] = {None: self.causal}

    def mask(self, window: int | None) -> torch.Tensor:
        """Which keys each query sees: causal, and within `window` tokens when given (cached per window)."""
        if window not in self.masks:
            self.masks[window] = self.causal & (self.k_pos > self.q_pos[:, :, None] - window)
        return self.masks[window]


class _PackedGroup(_Group):
    """Rows `rows` of a packed step, any query lengths; sized from the lengths' values (a host sync)."""

    def __init__(self, meta: AttentionMetadata, rows: torch.Tensor, block_size: int) -> None:
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])[rows].long()
        k_lens = meta.seq_lens[rows].long()
        num_blocks = cdiv(int(k_lens.max()), block_size)
        q_ar = torch.arange(int(q_lens.max()), device=rows.device)
        self.q_valid = q_ar[None, :] < q_lens[:, None]
        self.q_index = (meta.cu_seqlens_q[rows].long()[:, None] + q_ar[None, :])[self.q_valid]
        super().__init__(meta.block_table[rows, :num_blocks].long(), _rows_of(meta.ring_block_table, rows, num_blocks),
                         (k_lens - q_lens)[:, None] + q_ar[None, :], k_lens, block_size)

    def gather(self, q: torch.Tensor) -> torch.Tensor:
        """The group's queries `[rows, max_q, Hq, D]`, zero past each row's own."""
        rows, max_q = self.q_valid.shape
        qp = q.new_zeros(rows, max_q, *q.shape[1:])
        qp[self.q_valid] = q[self.q_index]
        return qp

    def scatter(self, out: torch.Tensor, res: torch.Tensor) -> None:
        """Write the valid rows of `res` `[rows, max_q, Hq, D]` to their packed tokens in `out`."""
        out[self.q_index] = res[self.q_valid]


class _DecodeGroup(_Group):
    """Rows `start:stop` of a padded decode step (`AttentionMetadata.decode_graph`): row `b`'s one
    query is token `b`, and `num_blocks` comes from the KV bucket, so nothing reads a value on the
    host. A padding row (length 0) sees key 0 of block 0, so it stays finite; its output is discarded."""

    def __init__(self, meta: AttentionMetadata, start: int, stop: int, num_blocks: int, block_size: int) -> None:
        self.rows = slice(start, stop)
        k_lens = meta.seq_lens[start:stop].long().clamp(min=1)
        super().__init__(meta.block_table[start:stop, :num_blocks].long(),
                         _rows_of(meta.ring_block_table, self.rows, num_blocks), (k_lens - 1)[:, None], k_lens,
                         block_size)

    def gather(self, q: torch.Tensor) -> torch.Tensor:
        """The group's queries `[rows, 1, Hq, D]`."""
        return q[self.rows, None]

    def scatter(self, out: torch.Tensor, res: torch.Tensor) -> None:
        """Write `res` `[rows, 1, Hq, D]` to the group's tokens in `out`."""
        out[self.rows] = res[:, 0]


def _rows_of(table: torch.Tensor | None, rows: torch.Tensor | slice, num_blocks: int) -> torch.Tensor | None:
    return None if table is None else table[rows, :num_blocks].long()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                    scale: float, sliding_window: int | None, softcap: float | None,
                    out: torch.Tensor, sinks: torch.Tensor | None = None, ring: bool = False) -> None:
    """Attend the group's queries over their cached keys (in their ring's blocks, with `ring`); write rows of
    `out` `[T, Hq, Dv]` (values are the first Dv of each cached value). A sink logit per query head joins each
    softmax as one more column, dropped after.

    Keys and values are gathered whole blocks at a time and multiplied per KV head as strided
    views, so no per-token gather or transposed copy of the cache is made.
    """
    rows, max_q = group.q_pos.shape
    h_q, d, dv = q.shape[1], q.shape[2], out.shape[2]
    h_kv = k_cache.shape[2]
    g = h_q // h_kv
    qp = group.gather(q)
    blocks = (group.ring_blocks if ring else group.blocks).flatten()
    keys = k_cache.index_select(0, blocks).view(rows, -1, h_kv, d)
    values = (keys if v_cache.data_ptr() == k_cache.data_ptr() else
              v_cache.index_select(0, blocks).view(rows, -1, h_kv, d))[..., :dv]
    hidden = ~group.mask(sliding_window)[:, None]
    res = q.new_empty(rows, max_q, h_kv, g, dv)
    for h in range(h_kv):
        qh = qp[:, :, h * g:(h + 1) * g].transpose(1, 2).reshape(rows, g * max_q, d)
        scores = torch.bmm(qh, keys[:, :, h].transpose(1, 2)).mul_(scale)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(rows, g, max_q, -1).masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks[h * g:(h + 1) * g].to(scores.dtype).view(1, g, 1, 1).expand(rows, g, max_q, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        probs = (probs[..., :-1] if sinks is not None else probs).reshape(rows, g * max_q, -1)
        res[:, :, h] = torch.bmm(probs, values[:, :, h]).view(rows, g, max_q, dv).transpose(1, 2)
    group.scatter(out, res.view(rows, max_q, h_q, dv))


class TorchBackend(AttentionBackend):
    """Decodes (one query token) and prefill chunks in separate batched problems, each split into
    groups of rows whose gathered K/V stay small (~`chunk_bytes`): small temporaries stay in the cache
    and in the allocator's pool instead of faulting in fresh pages every layer."""

    chunk_bytes = 2 << 20

    def __init__(self, kv_cache: KvCache) -> None:
        super().__init__(kv_cache)
        self.block_bytes = max(kv[0][0].numel() for kv in kv_cache.layers if kv is not None) * kv_cache.dtype.itemsize

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        """Take the step's metadata and group its sequences into row groups of bounded K/V size: sorted
        by their lengths' values, so that rows padded to a group's longest are padded little; for a
        decode graph step by its key alone (no host sync)."""
        super().prepare_metadata(meta)
        if meta.decode_graph:
            self.groups = self._decode_groups(meta)
            return
        q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        self.groups = []
        for rows in ((q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten()):
            if rows.numel():
                lengths, order = meta.seq_lens[rows].sort(stable=True)
                rows = rows[order]
                self.groups += [_PackedGroup(meta, rows[i:j], self.block_size)
                                for i, j in self._spans(lengths.tolist())]

    def _spans(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Split rows sorted by length into runs whose gathered K/V (each row padded to the run's
        last, longest, row) stay within `chunk_bytes`; sorting keeps that padding small."""
        spans, start = [], 0
        for i, length in enumerate(lengths):
            if i > start and (i + 1 - start) * self._row_bytes(length) > self.chunk_bytes:
                spans.append((start, i))
                start = i
        return spans + [(start, len(lengths))]

    def _decode_groups(self, meta: AttentionMetadata) -> list[_Group]:
        """Every row of a padded decode step, each gathering the blocks of `max_seqlen_k` keys (the KV
        bucket): a bucket smaller than a sequence would drop its later keys."""
        num_rows = meta.seq_lens.shape[0]
        size = self._rows_per_group(meta.max_seqlen_k)
        num_blocks = cdiv(meta.max_seqlen_k, self.block_size)
        return [_DecodeGroup(meta, i, min(i + size, num_rows), num_blocks, self.block_size)
                for i in range(0, num_rows, size)]

    def _rows_per_group(self, max_seq_len: int) -> int:
        return max(1, self.chunk_bytes // self._row_bytes(max_seq_len))

    def _row_bytes(self, seq_len: int) -> int:
        """Bytes of K (or V) gathered for one row of `seq_len` keys: whole blocks."""
        return cdiv(seq_len, self.block_size) * self.block_bytes

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k/v into layer `layer`'s cache (unless an earlier layer stored them), then attend
        group by group."""
        k_cache, v_cache = self.kv_cache.layers[layer]
        if self.kv_cache.stores[layer]:
            store_kvcache(k, v, k_cache, v_cache, self.tables(layer)[1])
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        for group in self.groups:
            paged_attention(q, k_cache, v_cache, group, scale, sliding_window, softcap, out, sinks,
                            self.kv_cache.rings[layer])
        return out

"""The reference paged attention in plain torch: vectorised per group of sequences, CPU and tests."""

from __future__ import annotations

import torch

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.sequence import cdiv


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k/v `[T, Hkv, D]` into caches `[num_blocks, block_size, Hkv, D]` at `slot_mapping`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])


class _Group:
    """Sequences padded to one [rows, max_q] x [rows, max_blocks * block_size] problem, with masks."""

    def __init__(self, meta: AttentionMetadata, rows: torch.Tensor, block_size: int) -> None:
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])[rows].long()
        k_lens = meta.seq_lens[rows].long()
        num_blocks = cdiv(int(k_lens.max()), block_size)
        q_ar = torch.arange(int(q_lens.max()), device=rows.device)
        k_ar = torch.arange(num_blocks * block_size, device=rows.device)
        self.q_valid = q_ar[None, :] < q_lens[:, None]
        self.q_index = (meta.cu_seqlens_q[rows].long()[:, None] + q_ar[None, :])[self.q_valid]
        self.blocks = meta.block_table[rows, :num_blocks].long()
        self.q_pos = (k_lens - q_lens)[:, None] + q_ar[None, :]
        self.k_pos = k_ar[None, None, :]
        self.causal = (self.k_pos <= self.q_pos[:, :, None]) & (self.k_pos < k_lens[:, None, None])
        self.masks: dict[int | None, torch.Tensor] = {None: self.causal}

    def mask(self, window: int | None) -> torch.Tensor:
        """Which keys each query sees: causal, and within `window` tokens when given (cached per window)."""
        if window not in self.masks:
            self.masks[window] = self.causal & (self.k_pos > self.q_pos[:, :, None] - window)
        return self.masks[window]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                    scale: float, sliding_window: int | None, softcap: float | None,
                    out: torch.Tensor) -> None:
    """Attend the group's queries over their cached keys; write rows of `out` `[T, Hq, D]`.

    Keys and values are gathered whole blocks at a time and multiplied per KV head as strided
    views, so no per-token gather or transposed copy of the cache is made.
    """
    rows, max_q = group.q_valid.shape
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    g = h_q // h_kv
    qp = q.new_zeros(rows, max_q, h_q, d)
    qp[group.q_valid] = q[group.q_index]
    keys = k_cache.index_select(0, group.blocks.flatten()).view(rows, -1, h_kv, d)
    values = v_cache.index_select(0, group.blocks.flatten()).view(rows, -1, h_kv, d)
    hidden = ~group.mask(sliding_window)[:, None]
    res = q.new_empty(rows, max_q, h_kv, g, d)
    for h in range(h_kv):
        qh = qp[:, :, h * g:(h + 1) * g].transpose(1, 2).reshape(rows, g * max_q, d)
        scores = torch.bmm(qh, keys[:, :, h].transpose(1, 2)).mul_(scale)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(rows, g, max_q, -1).masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(rows, g * max_q, -1)
        res[:, :, h] = torch.bmm(probs, values[:, :, h]).view(rows, g, max_q, d).transpose(1, 2)
    out[group.q_index] = res.view(rows, max_q, h_q, d)[group.q_valid]


class TorchBackend(AttentionBackend):
    """Decodes (one query token) and prefill chunks in separate batched problems, each split into
    groups of rows whose gathered K/V stay small (~`chunk_bytes`): small temporaries stay in the cache
    and in the allocator's pool instead of faulting in fresh pages every layer."""

    chunk_bytes = 2 << 20

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        """Take the step's metadata and group its sequences into row groups of bounded K/V size."""
        super().prepare_metadata(meta)
        q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        self.groups = []
        for rows in ((q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten()):
            if rows.numel():
                size = self._rows_per_group(int(meta.seq_lens[rows].max()))
                self.groups += [_Group(meta, rows[i:i + size], self.block_size)
                                for i in range(0, rows.numel(), size)]

    def _rows_per_group(self, max_seq_len: int) -> int:
        per_token = self.kv_cache[0, 0, 0, 0].numel() * self.kv_cache.element_size()
        per_row = cdiv(max_seq_len, self.block_size) * self.block_size * per_token
        return max(1, self.chunk_bytes // per_row)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        """Store this step's k/v into layer `layer`'s cache, then attend group by group."""
        k_cache, v_cache = self.kv_cache[layer]
        store_kvcache(k, v, k_cache, v_cache, self.meta.slot_mapping)
        out = torch.empty_like(q)
        for group in self.groups:
            paged_attention(q, k_cache, v_cache, group, scale, sliding_window, softcap, out)
        return out

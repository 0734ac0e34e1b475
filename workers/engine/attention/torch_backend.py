"""The reference paged attention in plain torch: vectorised per group of sequences, CPU and tests."""

from __future__ import annotations

import torch

from workers.engine.attention.base import AttentionBackend, AttentionMetadata


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k/v `[T, Hkv, D]` into caches `[num_blocks, block_size, Hkv, D]` at `slot_mapping`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])


class _Group:
    """Sequences padded to one [rows, max_q] x [rows, max_k] problem, with their shared masks."""

    def __init__(self, meta: AttentionMetadata, rows: torch.Tensor, block_size: int) -> None:
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1])[rows].long()
        k_lens = meta.seq_lens[rows].long()
        q_ar = torch.arange(int(q_lens.max()), device=rows.device)
        k_ar = torch.arange(int(k_lens.max()), device=rows.device)
        self.q_valid = q_ar[None, :] < q_lens[:, None]
        self.q_index = (meta.cu_seqlens_q[rows].long()[:, None] + q_ar[None, :])[self.q_valid]
        blocks = meta.block_table[rows].long()[:, k_ar // block_size]
        self.slots = blocks * block_size + (k_ar % block_size)[None, :]
        self.q_pos = (k_lens - q_lens)[:, None] + q_ar[None, :]
        self.k_pos = k_ar[None, None, :]
        self.causal = (self.k_pos <= self.q_pos[:, :, None]) & (k_ar[None, None, :] < k_lens[:, None, None])
        self.masks: dict[int | None, torch.Tensor] = {None: self.causal}

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = self.causal & (self.k_pos > self.q_pos[:, :, None] - window)
        return self.masks[window]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                    scale: float, sliding_window: int | None, softcap: float | None,
                    out: torch.Tensor) -> None:
    """Attend the group's queries over their cached keys; write rows of `out` `[T, Hq, D]`."""
    rows, max_q = group.q_valid.shape
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    qp = q.new_zeros(rows, max_q, h_q, d)
    qp[group.q_valid] = q[group.q_index]
    qp = qp.view(rows, max_q, h_kv, h_q // h_kv, d).permute(0, 2, 3, 1, 4).reshape(rows, h_kv, -1, d)
    keys = k_cache.view(-1, h_kv, d)[group.slots].transpose(1, 2)
    values = v_cache.view(-1, h_kv, d)[group.slots].transpose(1, 2)
    scores = torch.matmul(qp, keys.transpose(-1, -2)).mul_(scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(rows, h_kv, h_q // h_kv, max_q, -1)
    scores.masked_fill_(~group.mask(sliding_window)[:, None, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(rows, h_kv, -1, keys.shape[2])
    res = torch.matmul(probs, values).view(rows, h_kv, h_q // h_kv, max_q, d)
    out[group.q_index] = res.permute(0, 3, 1, 2, 4).reshape(rows, max_q, h_q, d)[group.q_valid]


class TorchBackend(AttentionBackend):
    """Decodes (one query token) in one batched problem, prefill chunks in another."""

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        super().prepare_metadata(meta)
        q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
        self.groups = []
        for rows in ((q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten()):
            if rows.numel():
                self.groups.append(_Group(meta, rows, self.block_size))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer]
        store_kvcache(k, v, k_cache, v_cache, self.meta.slot_mapping)
        out = torch.empty_like(q)
        for group in self.groups:
            paged_attention(q, k_cache, v_cache, group, scale, sliding_window, softcap, out)
        return out

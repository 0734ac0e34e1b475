"""What every attention backend shares: per-step metadata and the backend interface."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.kv_cache import KvCache


@dataclass
class AttentionMetadata:
    """Where the packed tokens of one step sit, set once per step and read by every layer.

    Tokens of sequence `b` are rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of the packed batch; they are
    its last positions, so sequence `b` attends over `seq_lens[b]` cached tokens (the new ones
    included) held in the blocks `block_table[b]`. `slot_mapping[t]` is the cache slot
    (block * block_size + offset) the K/V of token `t` is written to; -1 skips a padding token.

    `decode_graph` marks a padded decode step of a CUDA graph (workers/engine/graphs.py): token `b` is
    the one query of sequence `b`, sequences past the real ones have length 0 (`cu_seqlens_q` plateaus),
    and the host scalars are the graph key's (`max_seqlen_q` 1, `max_seqlen_k` the KV bucket). A backend
    must then take every host decision from those scalars and the tensors' shapes, never from values.

    `rows[b]` is sequence `b`'s block-table row, which also indexes its recurrent state (recurrent.py);
    `host_cu_seqlens_q` and `host_seq_lens` are the host copies a step that is not a decode step splits by.
    A layer that keeps only its window (window_ring.py) reads `ring_block_table` and writes `ring_slot_mapping`
    instead of `block_table` and `slot_mapping`.
    """

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    decode_graph: bool = False
    rows: torch.Tensor | None = None  # [B] int64
    host_cu_seqlens_q: np.ndarray | None = None
    host_seq_lens: np.ndarray | None = None
    ring_slot_mapping: torch.Tensor | None = None  # [T] int64
    ring_block_table: torch.Tensor | None = None  # [B, max_blocks] int32


class AttentionBackend:
    """Writes the new K/V of a step into the paged cache and attends over each sequence's blocks.

    `kv_cache.layers[i]` is layer i's `[2, num_blocks, block_size, num_kv_heads, head_dim]`.
    `runs_triton`: whether its kernels are Triton's (so other Triton kernels run here too, interpreted on the CPU).
    """

    runs_triton = False

    def __init__(self, kv_cache: KvCache) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.meta: AttentionMetadata | None = None

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        """Take this step's metadata; backends precompute what all layers share here."""
        self.meta = meta

    def tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table layer `layer` reads and the slot mapping it writes: its ring's when it keeps only
        its window."""
        meta = self.meta
        if self.kv_cache.rings[layer]:
            return meta.ring_block_table, meta.ring_slot_mapping
        return meta.block_table, meta.slot_mapping

    def graph_scalars(self, meta: AttentionMetadata) -> tuple:
        """The host scalars this backend bakes into the launches of a decode-graph step with metadata `meta`
        (besides the tensors' shapes): two keys of one batch bucket whose scalars are equal share a graph.
        By default the KV bucket itself (the torch backend gathers that many keys)."""
        return (meta.max_seqlen_k,)

    def decode_warmup_lengths(self, max_model_len: int) -> list[int]:
        """Values of `max_seqlen_k` at which one-sequence decode steps launch, between them, every kernel
        variant an eager decode step of at most `max_model_len` tokens can launch (none to compile here)."""
        return []

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` -> attention output `[T, Hq, Dv]`. Values may be
        narrower than keys (Dv < D: a latent attention layer's values are the first Dv of its keys, and its V
        plane is its K plane); the cache stores them in the first Dv of each value. `sinks` `[Hq]`: per query
        head, a logit that joins every softmax's denominator but has no value (attention sinks, gpt-oss)."""
        raise NotImplementedError

"""Paged attention with Triton kernels: GPU without compiled dependencies (CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import triton

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.attention.triton_kernels import LaunchConfig, paged_attention, store_kv
from workers.engine.kv_cache import KvCache

MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256
WIDE_HEAD = 256  # heads wider than this (a cached latent) aim at more programs per SM when split
WIDE_PROGRAMS_PER_SM = 8


def choose_num_splits(num_seqs: int, programs_per_seq: int, max_seqlen_q: int, max_seqlen_k: int,
                      num_sms: int, wide_heads: bool = False) -> int:
    """KV segments per program (a sequence's KV head, or slice of its query heads) for a step: >1 only for
    decode steps too small to fill the GPU over contexts of at least 2 x MIN_SPLIT_TOKENS. Narrow heads aim
    at two programs per SM, the count rounded up; `wide_heads` at WIDE_PROGRAMS_PER_SM, rounded down: at
    DeepSeek-V2-Lite's latent of 64-256 sequences that was the best count or within 4% of it on an H100 and
    an H200, where two per SM chose counts up to 27% slower (docs/benchmarks.md)."""
    programs = num_seqs * programs_per_seq
    if max_seqlen_q != 1 or programs == 0:
        return 1
    if wide_heads:
        wanted = WIDE_PROGRAMS_PER_SM * num_sms // programs
        wanted = 1 << (wanted.bit_length() - 1) if wanted else 1
    elif programs >= 2 * num_sms:
        return 1
    else:
        wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    by_length = max(1, max_seqlen_k // MIN_SPLIT_TOKENS)
    limit = min(MAX_SPLITS, 1 << (by_length.bit_length() - 1))
    splits = min(wanted, limit)
    return splits if splits > 1 else 1


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  decode_only: bool, num_splits: int) -> LaunchConfig:
    """Tile shape: decode tiles hold one token's query heads, mixed tiles several tokens'. `head_dim` is the
    values' width (a latent layer's keys add a narrow tail).

    Fewer keys per step for head_dim 256 and for float32 (exact fp32 dots), fewer query rows for head_dim
    512 (Gemma 4's global layers, latent attention), at most 16 query heads per program for those (a latent
    head's group of 128 is split in 8), and 8 warps for mixed tiles: otherwise the tiles spill registers on
    sm_80/sm_90 (scripts/kernel_resources.py)."""
    group = num_heads // num_kv_heads
    head_splits = group // 16 if head_dim > 256 and group > 16 and group % 16 == 0 else 1
    group //= head_splits
    tile_n = 16 if dtype == torch.float32 or head_dim > 256 else 32 if head_dim > 128 else 64
    if decode_only:
        return LaunchConfig(block_m=max(16, triton.next_power_of_2(group)), block_q=1,
                            tile_n=tile_n, num_splits=num_splits, head_splits=head_splits)
    block_m = max(32 if head_dim > 256 else 64, triton.next_power_of_2(group))
    return LaunchConfig(block_m=block_m, block_q=block_m // group, tile_n=tile_n, num_splits=num_splits,
                        num_warps=8, num_stages=3 if tile_n == 64 else 2, head_splits=head_splits)


class TritonBackend(AttentionBackend):
    """Stores K/V and attends with the Triton kernels of `triton_kernels`.

    `num_kv_splits` forces the split-KV path (N > 1) or the single-pass path (1) for every step;
    None chooses per step in `prepare_metadata` with `choose_num_splits`. Host metadata
    (`max_seqlen_q == 1`, `max_seqlen_k`) only picks the tile shape and the split count; every
    launch reads lengths from tensors, so a captured CUDA graph replays correctly for any lengths.
    In a decode graph step those scalars are the key's (the KV bucket, the padded batch), so the
    split count a graph bakes in is a function of its key. The heuristic counts `programs_per_seq`, the
    programs of one sequence's widest layer (KV heads times query-head slices: 8 for DeepSeek-V3's latent
    head), learned from the first forward (the engine's warm-up); until then the cache's KV heads.
    """

    runs_triton = True

    def __init__(self, kv_cache: KvCache, num_kv_splits: int | None = None) -> None:
        super().__init__(kv_cache)
        if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
            raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        # on CPU (the interpreter, tests) there is nothing to fill: the heuristic never splits
        self.num_sms = (torch.cuda.get_device_properties(kv_cache.device).multi_processor_count
                        if kv_cache.is_cuda else 1)
        self.num_splits = 1
        self.decode_only = False
        self.programs_per_seq = kv_cache.max_kv_heads
        self.wide_heads = kv_cache.max_head_dim > WIDE_HEAD

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        """Take the step's metadata and choose the decode tiles and the KV split count."""
        super().prepare_metadata(meta)
        self.decode_only = meta.max_seqlen_q == 1
        self.num_splits = self._splits(meta)

    def _splits(self, meta: AttentionMetadata) -> int:
        return self.num_kv_splits or choose_num_splits(meta.seq_lens.shape[0], self.programs_per_seq,
                                                       meta.max_seqlen_q, meta.max_seqlen_k, self.num_sms,
                                                       self.wide_heads)

    def graph_scalars(self, meta: AttentionMetadata) -> tuple:
        """The split count: the tile shape follows from the decode step and the tensors' shapes."""
        return (self._splits(meta),)

    def decode_warmup_lengths(self, max_model_len: int) -> list[int]:
        """One length per split count an eager decode step can choose: each power of two up to the count of a
        one-sequence decode at `max_model_len` (the most any decode gets), times MIN_SPLIT_TOKENS."""
        if self.num_kv_splits is not None:
            return [max_model_len]
        top = choose_num_splits(1, self.programs_per_seq, 1, max_model_len, self.num_sms, self.wide_heads)
        return [MIN_SPLIT_TOKENS << i for i in range(top.bit_length())]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k/v into layer `layer`'s cache (unless an earlier layer stored them), then attend;
        returns `[T, Hq, Dv]`."""
        meta = self.meta
        k_cache, v_cache = self.kv_cache.layers[layer]
        block_table, slots = self.tables(layer)
        if self.kv_cache.stores[layer]:
            store_kv(k, v, k_cache, v_cache, slots)
        config = launch_config(q.shape[1], k.shape[1], v.shape[2], q.dtype, self.decode_only,
                               self.num_splits)
        self.programs_per_seq = max(self.programs_per_seq, k.shape[1] * config.head_splits)
        return paged_attention(q, k_cache, v_cache, block_table, meta.seq_lens,
                               meta.cu_seqlens_q, scale, sliding_window, softcap, config, sinks, v.shape[2])

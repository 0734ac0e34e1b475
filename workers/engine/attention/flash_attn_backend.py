"""Paged attention through flash-attn 2 (when installed): `flash_attn_with_kvcache` for decode steps,
`flash_attn_varlen_func` with a block table for mixed steps."""

from __future__ import annotations

from types import ModuleType

import torch

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.kv_cache import KvCache

BLOCK_MULTIPLE = 256
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16)


def load_flash_attn() -> ModuleType:
    """Import `flash_attn`; a missing or broken install becomes a ValueError that says so."""
    try:
        import flash_attn
    except ImportError as err:
        raise ValueError(f"attention backend 'flash_attn' needs the flash-attn package, which does "
                         f"not import here ({err}); use 'triton' or 'auto' instead") from err
    return flash_attn


def check_config(kv_cache: KvCache) -> None:
    """Refuse a KV cache flash-attn's paged kernels cannot serve, naming the offending value."""
    block_size, head_dim = kv_cache.block_size, kv_cache.max_head_dim
    if kv_cache.dtype not in DTYPES:
        raise ValueError(f"flash-attn needs a float16 or bfloat16 KV cache, got {kv_cache.dtype}")
    if block_size % BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn's paged KV cache needs block_size to be a multiple of "
                         f"{BLOCK_MULTIPLE}, got block_size={block_size}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"flash-attn supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if any(kv_cache.values_are_keys):
        raise ValueError("flash-attn needs values as wide as keys; latent attention's values are part of its keys")
    if not kv_cache.is_cuda:
        raise ValueError(f"flash-attn needs a CUDA KV cache, got device {kv_cache.device}")


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 over the paged cache; K/V are stored with the Triton store kernel.

    Semantics match the torch reference: bottom-right causal alignment (queries are the last
    positions of their sequence), a sliding window W keeps keys with kpos > qpos - W, i.e. flash's
    `window_size=(W - 1, 0)`, and softcap is flash's `softcap`.
    """

    def __init__(self, kv_cache: KvCache) -> None:
        flash_attn = load_flash_attn()
        check_config(kv_cache)
        super().__init__(kv_cache)
        self._varlen = flash_attn.flash_attn_varlen_func
        self._with_kvcache = flash_attn.flash_attn_with_kvcache
        from workers.engine.attention.triton_kernels import store_kv
        self._store_kv = store_kv
        self.cu_seqlens_k: torch.Tensor | None = None

    def prepare_metadata(self, meta: AttentionMetadata) -> None:
        """Take the step's metadata and build the cumulative key lengths varlen calls need."""
        super().prepare_metadata(meta)
        self.cu_seqlens_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))

    def graph_scalars(self, meta: AttentionMetadata) -> tuple:
        """None: flash-attn's decode kernel takes its choices from the tensors' shapes."""
        return ()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k/v into layer `layer`'s cache (unless an earlier layer stored them), then attend;
        returns `[T, Hq, D]`."""
        if sinks is not None:
            raise NotImplementedError("attention sinks, which flash-attn 2 lacks (use attention_backend='triton')")
        meta = self.meta
        k_cache, v_cache = self.kv_cache.layers[layer]
        block_table, slots = self.tables(layer)
        if self.kv_cache.stores[layer]:
            self._store_kv(k, v, k_cache, v_cache, slots)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        if meta.max_seqlen_q == 1 and q.shape[0] == meta.seq_lens.shape[0]:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=block_table, softmax_scale=scale, causal=True,
                                     window_size=window, softcap=softcap or 0.0)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, self.cu_seqlens_k,
                            meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=scale, causal=True,
                            window_size=window, softcap=softcap or 0.0,
                            block_table=block_table)

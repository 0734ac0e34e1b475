"""Random packed attention steps over a paged cache, and the comparison of a backend with the torch
reference on them; shared by the tests of the Triton and flash-attn backends."""

from __future__ import annotations

import torch

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.attention.torch_backend import TorchBackend
from workers.engine.kv_cache import KvCache

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_metadata(pairs: list[tuple[int, int]], block_size: int, num_blocks: int, pad_tokens: int,
                  gen: torch.Generator, device: str, width: int = 1) -> AttentionMetadata:
    """A packed step over sequences given as (query_len, kv_len), blocks drawn at random; block
    table rows padded to at least `width` entries."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-kv_len // block_size))] for _, kv_len in pairs]
    width = max(width, max(len(t) for t in tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = []
    for (q_len, kv_len), table in zip(pairs, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(kv_len - q_len, kv_len)]
    q_lens = torch.tensor([q for q, _ in pairs], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(device, torch.int32),
        seq_lens=torch.tensor([k for _, k in pairs], dtype=torch.int32, device=device),
        block_table=block_table.to(device), max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=max(k for _, k in pairs))


def random_step(pairs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int,
                pad_tokens: int, device: str, dtype: torch.dtype, num_blocks: int = 0,
                width: int = 1, v_dim: int | None = None) -> tuple:
    """Metadata, a random two-layer cache (at least `num_blocks` blocks) and q/k/v `[T, H, D]`
    (non-contiguous, as a model's attention hands them over), seeded by the shapes. With `v_dim` the
    values are the first `v_dim` of the keys, and the cache holds one plane (latent attention)."""
    gen = torch.Generator().manual_seed(sum(q + k for q, k in pairs) + head_dim + block_size)
    num_heads, num_kv_heads = heads
    num_blocks = max(num_blocks, sum(-(-k // block_size) for _, k in pairs) + 3)
    meta = make_metadata(pairs, block_size, num_blocks, pad_tokens, gen, device, width)
    num_tokens = meta.slot_mapping.shape[0]
    planes = 2 if v_dim is None else 1
    cache = torch.randn(2, planes, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_heads, num_tokens, head_dim, generator=gen) * 2
    k, v = torch.randn(2, num_kv_heads, num_tokens, head_dim, generator=gen)
    cache, q, k, v = (x.to(device, dtype) for x in (cache, q.transpose(0, 1), k.transpose(0, 1),
                                                     v.transpose(0, 1)))
    return meta, cache, q, k, (v if v_dim is None else k[..., :v_dim])


def assert_matches_reference(backend: AttentionBackend, meta: AttentionMetadata, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, window: int | None,
                             softcap: float | None, sinks: torch.Tensor | None = None) -> None:
    """Layer 1 of `backend` (in q's dtype) against the torch reference (in float32 from the same
    rounded inputs and cache): outputs within the dtype's tolerance, caches equal after the store."""
    reference = TorchBackend(KvCache.of(backend.kv_cache.tensors[0].to(torch.float32, copy=True)))
    outputs = []
    for each, dt in ((reference, torch.float32), (backend, q.dtype)):
        each.prepare_metadata(meta)
        k_dt = k.to(dt)
        v_dt = k_dt[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v.to(dt)
        outputs.append(each.forward(1, q.to(dt), k_dt, v_dt, q.shape[2] ** -0.5, window,
                                    softcap, None if sinks is None else sinks.to(dt)).float())
    valid = int(meta.cu_seqlens_q[-1])
    tolerance = TOLERANCE[q.dtype]
    torch.testing.assert_close(outputs[1][:valid], outputs[0][:valid], atol=tolerance, rtol=tolerance)
    assert torch.equal(backend.kv_cache.tensors[0].float(), reference.kv_cache.tensors[0])

"""FlashAttnBackend's calls into flash-attn, checked without a GPU: a stand-in `flash_attn` module
computes what flash-attn 2's docstrings specify (paged K/V `[num_blocks, block_size, Hkv, D]`, a
block table, bottom-right causal alignment, `window_size=(left, right)` keeping keys in
`[i + Lk - Lq - left, i + Lk - Lq + right]`, `softcap * tanh(scores / softcap)`), slowly, and the
backend's output must equal the torch reference. This catches wrong lengths, layouts or window
arithmetic in our glue; flash-attn's kernels themselves only run where it is installed (GPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import CudaLooking
from tests.paged_cases import assert_matches_reference, random_step
from workers.engine.attention.flash_attn_backend import FlashAttnBackend
from workers.engine.kv_cache import KvCache

pytest.importorskip("triton")  # the backend stores K/V with the Triton store kernel


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
           seqlen_k: int, scale: float, window: tuple[int, int], softcap: float) -> torch.Tensor:
    """q `[Lq, Hq, D]` of one sequence against its paged keys, as flash-attn documents it."""
    keys = k_cache[table.long()].flatten(0, 1)[:seqlen_k].float()
    values = v_cache[table.long()].flatten(0, 1)[:seqlen_k].float()
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[0])[:, None] + seqlen_k - q.shape[0]
    j = torch.arange(seqlen_k)[None, :]
    allowed = j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values).to(q.dtype)


def fake_flash_attn(calls: list[str]) -> types.ModuleType:
    """A `flash_attn` module with the two paged entry points the backend uses; records calls."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, window_size, softcap, block_table):
        assert causal and block_table.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) <= max_seqlen_k
        calls.append("varlen")
        out = torch.zeros_like(q)
        for b in range(block_table.shape[0]):
            lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            out[lo:hi] = attend(q[lo:hi], k, v, block_table[b], seqlen_k, softmax_scale, window_size, softcap)
        return out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                     window_size, softcap):
        assert causal and q.dim() == 4 and q.shape[1] == 1
        calls.append("with_kvcache")
        return torch.stack([attend(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]),
                                   softmax_scale, window_size, softcap) for b in range(q.shape[0])])

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func, module.flash_attn_with_kvcache = varlen, with_kvcache
    return module



@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in replaces flash-attn on CPU only")
@pytest.mark.parametrize("pairs, pad_tokens, entry", [
    ([(1, 600), (5, 18), (129, 463), (1, 1), (7, 7), (0, 0), (1, 70)], 3, "varlen"),
    ([(1, 600), (1, 18), (1, 300), (1, 1)], 0, "with_kvcache"),
    ([(1, 600), (1, 18)], 2, "varlen"),
], ids=["mixed", "decode", "decode_with_padding"])
@pytest.mark.parametrize("window, softcap", [(None, None), (100, None), (None, 5.0), (100, 5.0)])
def test_flash_attn_backend_matches_reference(monkeypatch: pytest.MonkeyPatch, pairs, pad_tokens,
                                              entry, window, softcap) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(calls))
    meta, cache, q, k, v = random_step(pairs, (8, 2), 64, 256, pad_tokens, "cpu", torch.float16)
    backend = FlashAttnBackend(KvCache.of(cache.as_subclass(CudaLooking)))
    backend.kv_cache = KvCache.of(cache)  # the device check is passed; compute on the plain CPU tensor
    assert_matches_reference(backend, meta, q, k, v, window, softcap)
    assert calls == [entry]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in replaces flash-attn on CPU only")
def test_flash_attn_refuses_attention_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn 2 has no sinks: a layer with them raises, which refuses the model at its warm-up step."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn([]))
    meta, cache, q, k, v = random_step([(1, 18)], (8, 2), 64, 256, 0, "cpu", torch.float16)
    backend = FlashAttnBackend(KvCache.of(cache.as_subclass(CudaLooking)))
    backend.prepare_metadata(meta)
    with pytest.raises(NotImplementedError, match="attention sinks.*attention_backend='triton'"):
        backend.forward(1, q, k, v, 0.125, None, None, torch.zeros(8, dtype=q.dtype))

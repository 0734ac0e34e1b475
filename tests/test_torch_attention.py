"""The torch paged attention against a naive per-token softmax, with windows, softcap, sinks and GQA."""

from __future__ import annotations

import itertools

import pytest
import torch

from workers.engine.attention.base import AttentionMetadata
from workers.engine.attention.torch_backend import TorchBackend
from workers.engine.kv_cache import KvCache


def naive(q, keys, values, q_pos, scale, window, softcap, sinks=None):
    """One query row against one sequence's keys, every head, the slow and obvious way."""
    h_q, h_kv = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for h in range(h_q):
        s = keys[:, h // (h_q // h_kv)] @ q[h] * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(len(keys))
        allowed = pos <= q_pos
        if window:
            allowed &= pos > q_pos - window
        s[~allowed] = float("-inf")
        if sinks is not None:
            s = torch.cat([s, sinks[h:h + 1]])
        out[h] = torch.softmax(s, 0)[:len(keys)] @ values[:, h // (h_q // h_kv)]
    return out


@pytest.mark.parametrize("window, softcap, with_sinks", [(None, None, False), (3, None, False), (None, 5.0, False),
                                                        (6, 2.0, False), (None, None, True), (3, 2.0, True)])
@pytest.mark.parametrize("h_q, h_kv", [(4, 4), (8, 2), (5, 1)])
@pytest.mark.parametrize("chunk_blocks, num_groups", [(1 << 20, 2), (0, 5), (6, 4)],
                         ids=["one_group", "group_per_row", "six_blocks"])
def test_torch_backend_matches_naive(window, softcap, with_sinks, h_q, h_kv, chunk_blocks, num_groups):
    """Decodes and prefills apart, each sorted by length into groups of at most `chunk_blocks` gathered
    blocks per row group: six blocks put the decodes of 1 and 9 keys together (in reversed order)."""
    torch.manual_seed(0)
    bs, d, pairs = 4, 16, [(1, 9), (5, 5), (3, 13), (1, 1), (7, 20)]
    kv = torch.zeros(1, 2, 64, bs, h_kv, d)
    tables = torch.randperm(64)[: 6 * len(pairs)].view(len(pairs), 6).int()
    keys = [torch.randn(k, h_kv, d) for _, k in pairs]
    values = [torch.randn(k, h_kv, d) for _, k in pairs]
    slots = []
    for b, (q_len, k_len) in enumerate(pairs):
        for p in range(k_len):
            slot = int(tables[b, p // bs]) * bs + p % bs
            if p < k_len - q_len:
                kv[0, 0].view(-1, h_kv, d)[slot], kv[0, 1].view(-1, h_kv, d)[slot] = keys[b][p], values[b][p]
            else:
                slots.append(slot)
    new_k = torch.cat([keys[b][k - q:] for b, (q, k) in enumerate(pairs)])
    new_v = torch.cat([values[b][k - q:] for b, (q, k) in enumerate(pairs)])
    q = torch.randn(len(new_k), h_q, d)
    sinks = torch.randn(h_q) * 3 if with_sinks else None
    cu = torch.tensor([0, *itertools.accumulate(q for q, _ in pairs)], dtype=torch.int32)
    backend = TorchBackend(KvCache.of(kv))
    backend.chunk_bytes = chunk_blocks * bs * h_kv * d * kv.element_size()
    backend.prepare_metadata(AttentionMetadata(torch.tensor(slots), cu, torch.tensor([k for _, k in pairs],
                                               dtype=torch.int32), tables, 7, 20))
    assert len(backend.groups) == num_groups
    out = backend.forward(0, q, new_k, new_v, 0.3, window, softcap, sinks)
    for b, (q_len, k_len) in enumerate(pairs):
        for i in range(q_len):
            t = int(cu[b]) + i
            want = naive(q[t], keys[b], values[b], k_len - q_len + i, 0.3, window, softcap, sinks)
            torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


def test_rows_grouped_by_length_within_budget():
    """Rows sorted by length fill each group up to the byte budget, padded to the group's longest row."""
    bs, h_kv, d = 4, 2, 8
    backend = TorchBackend(KvCache.of(torch.zeros(1, 2, 128, bs, h_kv, d)))
    backend.chunk_bytes = 6 * bs * h_kv * d * 4
    lengths = [40, 5, 33, 6, 7, 41, 8]
    tables = torch.arange(len(lengths) * 11, dtype=torch.int32).view(len(lengths), 11)
    backend.prepare_metadata(AttentionMetadata(torch.zeros(len(lengths), dtype=torch.int64),
                                               torch.arange(len(lengths) + 1, dtype=torch.int32),
                                               torch.tensor(lengths, dtype=torch.int32), tables, 1, 41))
    groups = [[lengths[i] for i in group.q_index.tolist()] for group in backend.groups]
    assert groups == [[5, 6, 7], [8], [33], [40], [41]]

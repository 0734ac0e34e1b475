"""Triton kernels for the paged KV cache: store K/V by slot, and paged attention over mixed batches.

One attention kernel serves prefill chunks and decodes alike. A program owns one tile of
`BLOCK_Q` query tokens of one sequence and one KV head; the `G = Hq / Hkv` query heads sharing that
KV head are packed with the tokens into the `BLOCK_M` rows of the tile, so even a decode (one token)
feeds `tl.dot` with `G` rows. Programs map to (sequence, tile) by a binary search over
`cu_seqlens_q`, so every launch grid follows from tensor shapes and compile-time constants only
(CUDA-graph safe). With `num_splits > 1` each program covers one segment of the keys and writes a
partial result (unnormalised accumulator, running max, running sum); a second kernel merges them.
Tokens past the last sequence's (a decode graph's padding, one query per tile) get zeros as their output.
Attention sinks (a logit per query head in every softmax's denominator, with no value) join once, where
the softmax is normalised: in the single pass, or in the merge.
Values may be narrower than keys (latent attention, workers/engine/latent.py: one KV head whose values are
the first `V_DIM` of its 576-wide keys): keys are read as those first columns plus a tail, so no tile is
padded to a power of two above the key width, and the values are the keys' first columns, not read again.
A program may take a slice of a KV head's query heads (`HEAD_SPLITS`), so that wide heads of a large group
(128 query heads on one latent head) fit its registers.
Scores, softmax statistics and accumulators are float32 whatever the input dtype (fp32/fp16/bf16).
The batch size and the block-table width change from step to step, so they are not specialized on
(Triton compiles a variant per integer that is 1, a multiple of 16, or neither): a new one would stall
a step on a compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one attention launch: rows per tile, query tokens per tile, keys per step,
    KV segments per tile (a power of two; 1 is the single-pass path), warps and software pipeline stages
    per program, and the slices a KV head's query heads are split into (one program each)."""

    block_m: int
    block_q: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    head_splits: int = 1


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = dst + heads[:, None] * stride_ch + dims[None, :]
    v_mask = mask & (dims < V_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=v_mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _tile_start(cu_q_ptr, seq, BLOCK_Q: tl.constexpr):
    """Global index of the first query tile of `seq`: tiles of consecutive sequences never overlap."""
    return (tl.load(cu_q_ptr + seq) + seq * (BLOCK_Q - 1)) // BLOCK_Q


@triton.jit
def _find_sequence(cu_q_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile is at or before program `pid` (binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if _tile_start(cu_q_ptr, mid, BLOCK_Q) <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend(q, q_tail, q_pos, lo, hi, window, scale, softcap, k_base, v_base, bt_row_ptr, stride_cb,
            stride_cs, dims, dim_ok, tail, tail_ok, BLOCK_M: tl.constexpr, V_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, HAS_TAIL: tl.constexpr, V_IS_K: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of the tile's queries over key positions [lo, hi); returns (acc, max, sum). Keys are
    columns `dims` and (HAS_TAIL) `tail`; values are columns `dims`, of the keys themselves when V_IS_K."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
    for start in range(lo, hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        k_ok = k_pos < hi
        block = tl.load(bt_row_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        offs = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_TAIL:
            k_tail = tl.load(k_base + offs[:, None] + tail[None, :], mask=k_ok[:, None] & tail_ok[None, :],
                             other=0.0)
            s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
        s = s * scale
        if V_IS_K:
            v = k
        else:
            v = tl.load(v_base + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if USE_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        ok = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _add_sink(acc, m_i, l_i, sink):
    """Fold a sink logit (log2 units, like `m_i`) into an unnormalised softmax: (acc, sum) rescaled to it."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_new)


@triton.jit
def _key_range(seq_len, q_len, tile, window, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr):
    """This program's keys [lo, hi): of those any query of the tile may see (lo aligned down to
    TILE_N), segment `program_id(2)` of NUM_SPLITS, in whole TILE_N steps."""
    first_q_pos = seq_len - q_len + tile * BLOCK_Q
    hi = seq_len - q_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_q_pos - window + 1, 0) // TILE_N * TILE_N
    per_split = tl.cdiv(tl.cdiv(hi - lo, TILE_N), NUM_SPLITS) * TILE_N
    lo = lo + tl.program_id(2) * per_split
    return lo, tl.minimum(hi, lo + per_split)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr,
        part_acc_ptr, part_stats_ptr, sinks_ptr, scale, softcap, window, num_seqs, stride_qt, stride_qh,
        stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        G: tl.constexpr, HEAD_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
        V_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, V_IS_K: tl.constexpr, PRECISION: tl.constexpr):
    G_TILE: tl.constexpr = G // HEAD_SPLITS
    HAS_TAIL: tl.constexpr = HEAD_DIM > V_DIM
    pid = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_SPLITS
    first_head = kv_head * G + tl.program_id(1) % HEAD_SPLITS * G_TILE
    seq = _find_sequence(cu_q_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    tile = pid - _tile_start(cu_q_ptr, seq, BLOCK_Q)
    if tile * BLOCK_Q >= q_len:
        if BLOCK_Q == 1 and NUM_SPLITS == 1:  # program `pid` is padding token `pid`'s (a decode graph's)
            _store_zeros(out_ptr, pid.to(tl.int64), first_head, stride_ot, stride_oh, G_TILE, BLOCK_M, V_DIM,
                         V_PAD)
        return
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + rows // G_TILE
    head = first_head + rows % G_TILE
    row_ok = (rows < BLOCK_Q * G_TILE) & (q_idx < q_len)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, V_PAD)
    dim_ok = dims < V_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=io_mask, other=0.0)
    if HAS_TAIL:
        tail = V_DIM + tl.arange(0, TAIL_PAD)
        tail_ok = tail < HEAD_DIM
        q_tail = tl.load(q_rows + tail[None, :], mask=row_ok[:, None] & tail_ok[None, :], other=0.0)
    else:
        tail, tail_ok, q_tail = dims, dim_ok, q
    lo, hi = _key_range(seq_len, q_len, tile, window, BLOCK_Q, TILE_N, NUM_SPLITS, USE_WINDOW)
    acc, m_i, l_i = _attend(
        q, q_tail, seq_len - q_len + q_idx, lo, hi, window, scale, softcap,
        k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
        block_table_ptr + seq.to(tl.int64) * stride_bt, stride_cb, stride_cs, dims, dim_ok, tail, tail_ok,
        BLOCK_M, V_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFTCAP, HAS_TAIL, V_IS_K, PRECISION)
    if NUM_SPLITS == 1:
        if USE_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            acc, l_i = _add_sink(acc, m_i, l_i, sink)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        _store_partial(acc, m_i, l_i, part_acc_ptr, part_stats_ptr, token, head, dims, row_ok,
                       io_mask, tl.num_programs(1) * G_TILE, V_DIM, NUM_SPLITS)


@triton.jit
def _store_zeros(out_ptr, token, first_head, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                 HEADS_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr):
    """Zeros as `token`'s output in heads [first_head, first_head + NUM_HEADS): a padding token attends to
    nothing, and a row left unwritten would hold whatever the allocator last put there."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, V_PAD)
    zeros = tl.zeros([HEADS_PAD, V_PAD], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_ot + (first_head + heads)[:, None] * stride_oh + dims[None, :], zeros,
             mask=(heads < NUM_HEADS)[:, None] & (dims < V_DIM)[None, :])


@triton.jit
def _store_partial(acc, m_i, l_i, part_acc_ptr, part_stats_ptr, token, head, dims, row_ok, io_mask,
                   num_heads, V_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Write one KV segment's unnormalised accumulator and (max, sum) for the merge kernel."""
    part = (token * num_heads + head) * NUM_SPLITS + tl.program_id(2)
    tl.store(part_acc_ptr + part[:, None] * V_DIM + dims[None, :], acc, mask=io_mask)
    tl.store(part_stats_ptr + part * 2, m_i, mask=row_ok)
    tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_stats_ptr, sinks_ptr, cu_q_ptr, num_seqs, stride_ot,
                         stride_oh, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_q_ptr + num_seqs):
        _store_zeros(out_ptr, token, head, stride_ot, stride_oh, 1, 1, HEAD_DIM, HEAD_PAD)
        return
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    m = tl.load(part_stats_ptr + part * 2)
    l_s = tl.load(part_stats_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :],
                  other=0.0)
    num = tl.sum(acc * weight[:, None], 0)
    den = tl.sum(l_s * weight, 0)
    if USE_SINKS:
        den += tl.exp2(sink - m_max)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k `[T, Hkv, D]` and v `[T, Hkv, Dv]` (Dv <= D: the first Dv of each value) into caches
    `[num_blocks, block_size, Hkv, D]`; slots < 0 skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, V_DIM=v.shape[2], HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    scale: float, sliding_window: int | None, softcap: float | None,
                    config: LaunchConfig, sinks: torch.Tensor | None = None, v_dim: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries `[T, Hq, D]` over each sequence's cached blocks -> `[T, Hq, Dv]`,
    the values being the first `v_dim` (default D) of each cached value; `sinks` `[Hq]` are attention-sink
    logits."""
    q = _last_dim_contiguous(q)
    num_tokens, num_heads, head_dim = q.shape
    v_dim = v_dim or head_dim
    num_kv_heads, num_seqs = k_cache.shape[2], seq_lens.shape[0]
    out = q.new_empty(num_tokens, num_heads, v_dim)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    splits = config.num_splits
    part_acc = part_stats = out
    if splits > 1:
        part_acc = q.new_empty((num_tokens, num_heads, splits, v_dim), dtype=torch.float32)
        part_stats = q.new_empty((num_tokens, num_heads, splits, 2), dtype=torch.float32)
    grid = ((num_tokens + num_seqs * (config.block_q - 1)) // config.block_q, num_kv_heads * config.head_splits,
            splits)
    v_pad = max(16, triton.next_power_of_2(v_dim))
    tail_pad = max(16, triton.next_power_of_2(head_dim - v_dim)) if head_dim > v_dim else 0
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, part_acc, part_stats,
        out if sinks is None else sinks, scale, softcap or 0.0, sliding_window or 0, num_seqs, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), G=num_heads // num_kv_heads, HEAD_SPLITS=config.head_splits, HEAD_DIM=head_dim,
        V_DIM=v_dim, V_PAD=v_pad, TAIL_PAD=tail_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=config.block_m,
        BLOCK_Q=config.block_q, TILE_N=config.tile_n, NUM_SPLITS=splits, USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(softcap), USE_SINKS=sinks is not None, V_IS_K=v_cache.data_ptr() == k_cache.data_ptr(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=config.num_warps,
        num_stages=config.num_stages)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_stats, out if sinks is None else sinks, cu_seqlens_q, num_seqs,
            out.stride(0), out.stride(1), HEAD_DIM=v_dim, HEAD_PAD=v_pad, NUM_SPLITS=splits,
            USE_SINKS=sinks is not None)
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()

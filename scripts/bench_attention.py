"""GPU decode benchmark of the Triton paged-attention backend: time per call and achieved memory
bandwidth, against the device's own copy bandwidth measured first.

Decode steps (one new token per sequence) at 64 and 256 sequences of 1k and 8k cached tokens, one layer
shaped like Llama-3-8B by default (32 query heads, 8 KV heads, head_dim 128, bfloat16, block_size 16), every
sequence's blocks scattered at random over the cache. A call is the backend's `forward`: the K/V store of
the new tokens plus attention. Bytes counted: the cached K/V read, the block table, q read, the new k/v read
and stored, the output written. Each shape runs the single-pass path, the split-KV path and the backend's
own choice ("auto"), each timed replayed from a CUDA graph (the device time, as the engine's decode graphs
run it; GB/s from it) and launched eagerly (device time plus whatever host launch time the device waits for:
scripts/gpu_timing.py). The peer in the same run is torch's `scaled_dot_product_attention` (its fused
FlashAttention / memory-efficient kernels) over the same keys held densely, `[seqs, kv_heads, context,
head_dim]`: no block table, no K/V store, so it is the speed a paged kernel aims at, not a like-for-like
call. Heads wider than 256, which sdpa's fused kernels do not take, get a grouped matmul instead
("matmul"). `--value-dim` makes the values the keys' first columns, one cache plane read once: multi-head
latent attention cached as its latent (`--heads 128 --kv-heads 1 --head-dim 576 --value-dim 512` is DeepSeek-V3's
shape).

Usage: python scripts/bench_attention.py [--seqs 64 256] [--context 1024 8192] [--dtype bfloat16] [--value-dim V]
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

import torch
from arg_types import positive_int
from bench_gpu_runs import copy_bandwidth
from gpu_timing import time_call

from workers.engine.attention.base import AttentionMetadata
from workers.engine.kv_cache import KvCache

ROW = "{:>6} {:>8} {:>8} {:>7} {:>10} {:>10} {:>9} {:>8} {:>12}"


def parse_args() -> argparse.Namespace:
    """Command-line options: the shapes to run and the model's attention geometry."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=positive_int, nargs="+", default=[64, 256],
                        help="sequences decoding, one shape each (default 64 256)")
    parser.add_argument("--context", type=positive_int, nargs="+", default=[1024, 8192],
                        help="cached tokens per sequence, one shape each (default 1024 8192)")
    parser.add_argument("--heads", type=positive_int, default=32, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=positive_int, default=8, help="key/value heads (default 8)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="key width (default 128)")
    parser.add_argument("--value-dim", type=positive_int, default=None,
                        help="values are the keys' first VALUE_DIM columns, one cache plane (latent attention; "
                             "default: separate values as wide as the keys)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per cache block (default 16)")
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[8],
                        help="KV segments of the split path (several: a split row each; default 8)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="cache and query dtype (default bfloat16)")
    return parser.parse_args()


def decode_step(seqs: int, context: int, args: argparse.Namespace,
                ) -> tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, ...], int]:
    """A filled one-layer cache, the step's metadata and q/k/v, plus the bytes one call moves."""
    dtype, bs = getattr(torch, args.dtype), args.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = seqs * blocks_per_seq
    planes = 1 if args.value_dim else 2
    kv_cache = torch.empty(1, planes, num_blocks, bs, args.kv_heads, args.head_dim, dtype=dtype,
                           device="cuda").normal_()
    block_table = torch.randperm(num_blocks, device="cuda").view(seqs, blocks_per_seq).int()
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=block_table[:, last // bs].long() * bs + last % bs,
        cu_seqlens_q=torch.arange(seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((seqs,), context, dtype=torch.int32, device="cuda"),
        block_table=block_table, max_seqlen_q=1, max_seqlen_k=context)
    q = torch.randn(seqs, args.heads, args.head_dim, dtype=dtype, device="cuda")
    k, v = torch.randn(2, seqs, args.kv_heads, args.head_dim, dtype=dtype, device="cuda")
    v = k[..., :args.value_dim] if args.value_dim else v
    size = kv_cache.element_size()
    kv_bytes = planes * seqs * context * args.kv_heads * args.head_dim * size
    moved = (kv_bytes + block_table.numel() * 4 + 2 * q.numel() * size + 4 * k.numel() * size)
    return kv_cache, meta, (q, k, v), moved


def dense_kv(kv_cache: torch.Tensor, meta: AttentionMetadata, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values copied out of the paged cache, `[seqs, kv_heads, context, dim]`."""
    context = meta.max_seqlen_k
    k_all, v_all = (kv_cache[0, i][meta.block_table.long()].flatten(1, 2)[:, :context].transpose(1, 2)
                    .contiguous() for i in (0, kv_cache.shape[1] - 1))
    return k_all, v_all[..., :value_dim].contiguous()


def sdpa_peer(k_all: torch.Tensor, v_all: torch.Tensor, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """torch's fused attention for the same decode over the dense keys and values."""
    q4 = q.view(q.shape[0], q.shape[1], 1, q.shape[2])
    return functools.partial(torch.nn.functional.scaled_dot_product_attention, q4, k_all, v_all,
                             enable_gqa=True)


def grouped_peer(k_all: torch.Tensor, v_all: torch.Tensor, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v with each KV head's query group in one batched matmul. For heads wider than
    sdpa's fused kernels take (256), sdpa falls back to a math path that copies K/V, in float32, for every
    query head: at 256 sequences of DeepSeek-V2-Lite's latent 32 GiB for the values alone, more than an
    H100 had beside the cache (2026-11-26)."""
    seqs, heads, dim = q.shape
    q_groups = q.view(seqs, k_all.shape[1], heads // k_all.shape[1], dim)

    def attend() -> torch.Tensor:
        scores = (q_groups @ k_all.transpose(-1, -2)).float() * dim ** -0.5
        return (scores.softmax(-1).to(v_all.dtype) @ v_all).view(seqs, heads, 1, v_all.shape[-1])
    return attend


def bench_shape(seqs: int, context: int, args: argparse.Namespace, copy_gbs: float) -> None:
    """Time the single-pass, split and heuristic paths and the sdpa peer for one shape; a row each,
    with the largest difference of each output from the peer's."""
    from workers.engine.attention.triton_backend import TritonBackend

    kv_cache, meta, (q, k, v), moved = decode_step(seqs, context, args)
    results = []
    for path, forced in (("single", 1), *(("split", n) for n in args.splits), ("auto", None)):
        backend = TritonBackend(KvCache.of(kv_cache), num_kv_splits=forced)
        backend.prepare_metadata(meta)
        step = functools.partial(backend.forward, 0, q, k, v, args.head_dim ** -0.5, None, None)
        results.append((path, backend.num_splits, step(), step))
    k_all, v_all = dense_kv(kv_cache, meta, v.shape[-1])  # after the stores above: with the new tokens
    name, make_peer = ("sdpa", sdpa_peer) if args.head_dim <= 256 else ("matmul", grouped_peer)
    peer = make_peer(k_all, v_all, q)
    want = peer().view(*q.shape[:2], v.shape[-1])
    results.append((name, "-", want, peer))
    for path, splits, out, call in results:
        timed = time_call(call)
        gbs = moved / timed.ms / 1e6
        diff = (out.float() - want.float()).abs().max().item()
        print(ROW.format(seqs, context, path, splits, *timed.cells(), f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                         f"{diff:.1e}"))
        if note := timed.note(path):
            print(note)


def main() -> None:
    """Check for a GPU and Triton, measure copy bandwidth, then print the table."""
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU: torch.cuda.is_available() is False here. "
                 "On CPU the kernels are only tested (tests/test_triton_kernels.py, interpreted).")
    try:
        import triton  # noqa: F401
    except ImportError as err:
        sys.exit(f"bench_attention.py needs Triton ({err}); install it with `pip install triton`")
    copy_gbs = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: device copy bandwidth {copy_gbs:.0f} GB/s; "
          f"{args.heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"{f'values the first {args.value_dim} of the keys, ' if args.value_dim else ''}"
          f"{args.dtype}, block_size {args.block_size}")
    print(ROW.format("seqs", "context", "path", "splits", "graph (us)", "eager (us)", "GB/s", "of copy",
                     "diff vs peer"))
    for seqs in args.seqs:
        for context in args.context:
            bench_shape(seqs, context, args, copy_gbs)


if __name__ == "__main__":
    main()

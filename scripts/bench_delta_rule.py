"""GPU benchmark of a Gated DeltaNet layer's decode: the engine's in-place kernels against transformers'.

One decode token for each of --rows sequences, one layer shaped like Qwen3.5's linear-attention layers by
default (16 key heads, 32 value heads, head width 128: a 2 MiB float32 state per sequence), the rows'
states in slots scattered at random over a slot tensor, as in the engine. Three ways, in one run:
  in place  workers/engine/delta_rule_kernel.py: each state read from its slot and written back, once
  gathered  the engine's way before it: the rows' states gathered, transformers' rule, the new states
            written back to the slots
  rule      transformers' rule alone on states already in one batch tensor (no slots)
and the short convolution before the rule (4 taps over the layer's 8,192 channels of q, k and v), two ways:
  conv in place   the engine's kernel: each window read from its slot, shifted and written back, with
                  the convolution and SiLU
  conv gathered   the engine's way before it: the windows gathered, transformers' `causal_conv1d_update`
                  (the causal-conv1d package's kernel when installed, else torch), written back
transformers' rule is fla's fused kernel when flash-linear-attention is installed, else its PyTorch
reference (named in the header). Each way is timed replayed from a CUDA graph (the device time, as in the
engine's decode graphs) and launched eagerly (scripts/gpu_timing.py). GB/s, from the graph's time, counts
the states' (or windows') bytes read and written once, the least a decode must move; the last column is each
output's largest difference from the in-place kernel's.

Usage: python scripts/bench_delta_rule.py [--rows 64 256] [--kv-heads 16] [--heads 32] [--head-dim 128]
                                       [--tiles 32x4 64x8 ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
from bench_gpu_runs import copy_bandwidth
from gpu_timing import time_call

from workers.engine.delta_rule import InPlace

ROW = "{:>6} {:>17} {:>10} {:>10} {:>8} {:>8} {:>12}"


def parse_args() -> argparse.Namespace:
    """The rows to run and the layer's shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="sequences decoding (default 64 256)")
    parser.add_argument("--kv-heads", type=int, default=16, help="key heads (default 16)")
    parser.add_argument("--heads", type=int, default=32, help="value heads (default 32)")
    parser.add_argument("--head-dim", type=int, default=128, help="key and value head width (default 128)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="q, k, v dtype; the states are float32 (default bfloat16)")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="BVxWARPS",
                        help="also time the in-place kernel with these tiles, e.g. 64x8: value columns per program "
                             "by warps (the kernel's default: BLOCK_V x NUM_WARPS)")
    return parser.parse_args()


def transformers_function(name: str) -> Callable[..., Any]:
    """Qwen3.5's decode function `name` as transformers resolved it (fla's kernel for the rule when
    installed), unwrapped."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
    function = getattr(qwen3_5, name)
    return function.function if isinstance(function, InPlace) else function


def step_inputs(rows: int, args: argparse.Namespace, dev: str = "cuda") -> dict:
    """q, k, v, g, beta of one token per row, the state slots and where each row's state lives; the
    convolution's input, weights and window slots."""
    dtype, dim = getattr(torch, args.dtype), args.head_dim
    slots = torch.randperm(rows + 2, device=dev)[:rows]
    channels = (2 * args.kv_heads + args.heads) * dim
    return dict(q=torch.randn(rows, 1, args.kv_heads, dim, dtype=dtype, device=dev),
                k=torch.randn(rows, 1, args.kv_heads, dim, dtype=dtype, device=dev),
                v=torch.randn(rows, 1, args.heads, dim, dtype=dtype, device=dev),
                g=-torch.rand(rows, 1, args.heads, device=dev),  # as the layers pass them
                beta=torch.rand(rows, 1, args.heads, dtype=dtype, device=dev),
                state=torch.randn(rows + 2, args.heads, dim, dim, device=dev) * 0.1, slots=slots,
                conv_x=torch.randn(rows, 1, channels, dtype=dtype, device=dev).transpose(1, 2),
                weight=torch.randn(channels, 4, dtype=dtype, device=dev),
                windows=torch.randn(rows + 2, channels, 4, dtype=dtype, device=dev))


def rule_ways(x: dict, rule: Callable[..., Any], tiles: list[str]) -> dict:
    """The rule's three ways, and the in-place kernel with each of `tiles`, each a call returning the output."""
    from workers.engine.delta_rule_kernel import gated_delta_decode
    group = x["v"].shape[2] // x["q"].shape[2]
    q, k = (x[name].repeat_interleave(group, 2) for name in ("q", "k"))  # what every rule version accepts
    batch = x["state"].index_select(0, x["slots"])
    call = dict(g=x["g"], beta=x["beta"], output_final_state=True, use_qk_l2norm_in_kernel=True)

    def gathered():
        out, new = rule(q, k, x["v"], initial_state=x["state"].index_select(0, x["slots"]), **call)
        x["state"].index_copy_(0, x["slots"], new.to(x["state"].dtype))
        return out

    def in_place():
        return gated_delta_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], x["slots"], x["slots"],
                                  True)

    return {"in place": in_place, "gathered": gathered,
            "rule": lambda: rule(q, k, x["v"], initial_state=batch, **call)[0],
            **{f"in place {tile}": tiled(tile, in_place) for tile in tiles}}


def tiled(tile: str, in_place: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`in_place` with the kernel's tile "BVxWARPS", set for each call (a graph's capture is one call)."""
    import workers.engine.delta_rule_kernel as kernel
    block_v, warps = map(int, tile.split("x"))

    def call():
        default = kernel.BLOCK_V, kernel.NUM_WARPS
        kernel.BLOCK_V, kernel.NUM_WARPS = block_v, warps
        try:
            return in_place()
        finally:
            kernel.BLOCK_V, kernel.NUM_WARPS = default

    return call


def conv_ways(x: dict, update: Callable[..., torch.Tensor]) -> dict:
    """The convolution's two ways, each a call returning the output."""
    from workers.engine.delta_rule_kernel import short_conv_decode

    def gathered():
        window = x["windows"].index_select(0, x["slots"])
        out = update(x["conv_x"], window, x["weight"], None, "silu")
        x["windows"].index_copy_(0, x["slots"], window)
        return out

    return {"conv in place": lambda: short_conv_decode(x["conv_x"], x["weight"], None, True, x["windows"],
                                                       x["slots"], x["slots"]),
            "conv gathered": gathered}


def first_outputs(x: dict, calls: dict, slots: str) -> dict:
    """Each way's output from the same states (the slots of `x[slots]` restored after each call)."""
    saved, outs = x[slots].clone(), {}
    for name, call in calls.items():
        outs[name] = call().float()
        x[slots].copy_(saved)
    return outs


def print_rows(rows: int, x: dict, calls: dict, slots: str, copy_gbs: float) -> None:
    """Time each way of `calls` over the slots `x[slots]` and print a row each."""
    moved, want = 2 * rows * x[slots][0].numel() * x[slots].element_size(), None
    for name, out in first_outputs(x, calls, slots).items():
        want = out if want is None else want
        timed = time_call(calls[name])
        gbs = moved / timed.ms / 1e6
        print(ROW.format(rows, name, *timed.cells(), f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}",
                         f"{(out - want).abs().max().item():.1e}"))
        if note := timed.note(name):
            print(note)


def main() -> None:
    """Check for a GPU, measure the copy bandwidth, print a row per rows x way."""
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_delta_rule.py needs a CUDA GPU; on the CPU the kernel is tested (tests/test_delta_rule.py)")
    copy_gbs, rule = copy_bandwidth("cuda"), transformers_function("torch_recurrent_gated_delta_rule")
    update = transformers_function("causal_conv1d_update")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; {args.kv_heads} key heads, "
          f"{args.heads} value heads, width {args.head_dim}, {args.dtype}; transformers' rule: {rule.__module__}, "
          f"its convolution update: {update.__module__}")
    print(ROW.format("rows", "way", "graph (us)", "eager (us)", "GB/s", "of copy", "diff"))
    for rows in args.rows:
        x = step_inputs(rows, args)
        print_rows(rows, x, rule_ways(x, rule, args.tiles), "state", copy_gbs)
        print_rows(rows, x, conv_ways(x, update), "windows", copy_gbs)


if __name__ == "__main__":
    main()

"""Compile the Triton attention kernels (and the Gated DeltaNet decode, the fused RMS norm) for NVIDIA GPUs
without one; print each kernel's registers, stack (spilled) bytes and shared memory.

Triton's compiler and the ptxas it bundles need no GPU: a stand-in driver names the target
architecture, and `TritonBackend.forward` then compiles, without running, every kernel it launches
(K/V store, paged attention for mixed and decode steps, single-pass and split-KV, the merge) for a
few real model shapes. This catches what the interpreter cannot: compile errors, bfloat16, spills.
Run it without TRITON_INTERPRET (the interpreter replaces the compiler).

Usage: python scripts/kernel_resources.py [--arch 80 90] [--dtype bfloat16 float16] [--models ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from workers.engine import delta_rule_kernel, norm_kernel
from workers.engine.attention import triton_kernels
from workers.engine.attention.base import AttentionMetadata
from workers.engine.attention.triton_backend import TritonBackend
from workers.engine.kv_cache import KvCache

# name: (query heads, KV heads, head_dim, sliding window, logit softcap, attention sinks)
MODELS = {
    "llama3-8b": (32, 8, 128, None, None, False),
    "qwen2.5-7b": (28, 4, 128, None, None, False),
    "mistral-7b": (32, 8, 128, 4096, None, False),
    "gemma2-9b": (16, 8, 256, 4096, 50.0, False),
    "gemma4-31b-window": (32, 16, 256, 1024, None, False),
    "gemma4-31b-global": (32, 4, 512, None, None, False),
    "deepseek-v2-lite": (16, 16, 192, None, None, False),  # MLA expanded: keys 128 + 64 wide, values padded
    "deepseek-v2-lite-latent": (16, 1, 576, None, None, False),  # MLA latent: one head of 512 + 64, V = K
    "deepseek-v3-latent": (128, 1, 576, None, None, False),
    "gpt-oss-20b": (64, 8, 64, 128, None, True),
}
# latent attention: the values' width, the first columns of the keys (one cache plane)
LATENT_V_DIM = {"deepseek-v2-lite-latent": 512, "deepseek-v3-latent": 512}
# path: (query tokens per sequence, forced KV splits)
PATHS = {"mixed": (4, 1), "decode": (1, 1), "split": (1, 8)}
KERNELS = ("_store_kv_kernel", "_paged_attention_kernel", "_merge_splits_kernel")
# Gated DeltaNet decode in place (path "decode" only): key heads, value heads, key and value head widths
DELTA_MODELS = {"qwen3.5-delta": (16, 32, 128, 128)}  # Qwen3.5's and Qwen3-Next's linear layers
DELTA_KERNELS = ("_gated_delta_decode_kernel", "_short_conv_decode_kernel")
# fused RMS norms (path "decode" only): (width, gated) of each norm a model's layers call
NORM_MODELS = {"qwen3.5-norms": ((4096, False), (256, False), (128, True)), "llama3-70b-norms": ((8192, False),),
               "llama3-405b-norms": ((16384, False),)}  # fused_norm.MAX_WIDTH: the widest it fuses
NORM_KERNELS = ("_rms_norm_kernel",)
ROW = "{:>5} {:>9} {:>11} {:>7} {:>24} {:>5} {:>6} {:>8}"


class TargetDriver:
    """Stands in for Triton's CUDA driver: names a GPU architecture so kernels compile, nothing runs."""

    def __init__(self, arch: int) -> None:
        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return self.arch  # kernels cache their target per device: one "device" per architecture

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


class CompileOnly:
    """Replaces a kernel in `triton_kernels`: `kernel[grid](...)` compiles for the target and records
    the compiled kernel instead of launching it."""

    def __init__(self, kernel: triton.JITFunction, compiled: dict) -> None:
        self.kernel, self.compiled = kernel, compiled

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def launch(*args, **kwargs) -> None:
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            self.compiled.setdefault(compiled.hash, (self.kernel.__name__, compiled))
        return launch


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, ... of a cubin, read with the cuobjdump that Triton bundles."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", text)}


def compile_step(model: str, path: str, dtype: torch.dtype) -> None:
    """One layer's forward of a two-sequence step through TritonBackend, compiled only."""
    heads, kv_heads, head_dim, window, softcap, sinks = MODELS[model]
    q_len, splits = PATHS[path]
    block_size, seqs = 16, 2
    v_dim = LATENT_V_DIM.get(model, head_dim)
    cache = torch.zeros(1, 2 if v_dim == head_dim else 1, 8, block_size, kv_heads, head_dim, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(seqs * q_len, dtype=torch.int64),
        cu_seqlens_q=torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32),
        seq_lens=torch.full((seqs,), 32, dtype=torch.int32),
        block_table=torch.zeros(seqs, 4, dtype=torch.int32), max_seqlen_q=q_len, max_seqlen_k=32)
    backend = TritonBackend(KvCache.of(cache), num_kv_splits=splits)
    backend.prepare_metadata(meta)
    q = torch.zeros(seqs * q_len, heads, head_dim, dtype=dtype)
    k = torch.zeros(seqs * q_len, kv_heads, head_dim, dtype=dtype)
    backend.forward(0, q, k, k[..., :v_dim], head_dim ** -0.5, window, softcap,
                    torch.zeros(heads, dtype=dtype) if sinks else None)


def compile_delta_rule(model: str, path: str, dtype: torch.dtype) -> None:
    """One Gated DeltaNet layer's in-place decode of two rows (delta_rule_kernel.py), compiled only: q, k, v
    in `dtype`, the states in float32 as transformers keeps them; the short convolution before it (no bias,
    4 taps) with its windows in `dtype`."""
    kv_heads, heads, head_k, head_v = DELTA_MODELS[model]
    q = torch.zeros(2, 1, kv_heads, head_k, dtype=dtype)
    v, gates = torch.zeros(2, 1, heads, head_v, dtype=dtype), torch.zeros(2, 1, heads)
    rows = torch.arange(2)
    delta_rule_kernel.gated_delta_decode(q, q, v, gates, gates.to(dtype), torch.zeros(3, heads, head_k, head_v),
                                         rows, rows, True)
    channels = 2 * kv_heads * head_k + heads * head_v
    x = torch.zeros(2, 1, channels, dtype=dtype).transpose(1, 2)
    delta_rule_kernel.short_conv_decode(x, torch.zeros(channels, 4, dtype=dtype), None, True,
                                        torch.zeros(3, channels, 4, dtype=dtype), rows, rows)


def compile_norms(model: str, path: str, dtype: torch.dtype) -> None:
    """A model's RMS norms over three rows (norm_kernel.py), compiled only."""
    for width, gated in NORM_MODELS[model]:
        x = torch.zeros(3, width, dtype=dtype)
        norm_kernel.rms_norm(x, torch.zeros(width, dtype=dtype), 1e-6, True, True, x if gated else None)


def kernels_of(model: str) -> tuple:
    """The module holding a model shape's kernels, their names, and the function that launches them."""
    if model in DELTA_MODELS:
        return delta_rule_kernel, DELTA_KERNELS, compile_delta_rule
    if model in NORM_MODELS:
        return norm_kernel, NORM_KERNELS, compile_norms
    return triton_kernels, KERNELS, compile_step


def compile_and_report(arch: int, dtype: str, model: str, path: str) -> None:
    """Compile one step's kernels for `arch` (launches replaced by compiles) and print a row each."""
    module, names, step = kernels_of(model)
    kernels = {name: getattr(module, name) for name in names}
    compiled: dict = {}
    driver.set_active(TargetDriver(arch))
    try:
        for name, kernel in kernels.items():
            setattr(module, name, CompileOnly(kernel, compiled))
        step(model, path, getattr(torch, dtype))
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    for name, kernel in compiled.values():
        usage = resource_usage(kernel.asm["cubin"])
        print(ROW.format(f"sm_{arch}", dtype, model, path, name.strip("_"), usage["REG"],
                         usage["STACK"], kernel.metadata.shared))


def main() -> None:
    """Compile every (arch, dtype, model, path) asked for and print the table; fails on any error."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90],
                        help="compute capabilities compiled for (default 80 90: A100, H100/H200)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"],
                        choices=["bfloat16", "float16", "float32"], help="dtypes (default bfloat16 float16)")
    shapes = [*MODELS, *DELTA_MODELS, *NORM_MODELS]
    parser.add_argument("--models", nargs="+", default=shapes, choices=shapes, help="model shapes (default: all)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    print(ROW.format("arch", "dtype", "model", "path", "kernel", "regs", "stack", "smem"))
    for arch, dtype, model in itertools.product(args.arch, args.dtype, args.models):
        for path in PATHS if model in MODELS else ["decode"]:
            compile_and_report(arch, dtype, model, path)


if __name__ == "__main__":
    main()

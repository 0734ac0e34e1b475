"""GPU benchmark of the RMS norms a decode step calls: transformers' modules against the engine's fused kernel.

For each model shape of bench_gpu.py (random bf16 weights, built from its configs), every kind of norm its
decode step calls, at --rows sequences decoding one token each:
  hidden   the decoder layers' two norms and the final one, over the hidden width (2 x layers + 1 calls)
  q, k     per-head query and key norms of the attention layers (Qwen3's and Qwen3.5's), a row per head
  gated    the Gated DeltaNet layers' output norm gated by SiLU (Qwen3.5's), a row per value head
Two ways, in one run: the module's own forward (transformers': about ten kernels of casts, power, mean,
rsqrt and products) and the engine's (workers/engine/fused_norm.py: one kernel, the variant chosen by
running the module). Each is timed replayed from a CUDA graph (the device time, as in the engine's decode
graphs) and launched eagerly (scripts/gpu_timing.py). GB/s, from the graph's time, counts the input (and
gate) read and the output written once; the last column is the largest difference from the module's output.
Below each model, the graph time a decode step spends in its norms, each way.

Usage: python scripts/bench_norm.py [--rows 64 256] [--models qwen3.5 llama-3.1-8b qwen3-1.7b]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers
from bench_gpu_runs import MODELS, copy_bandwidth
from gpu_timing import time_call

from workers.engine.fused_norm import fuse_norms

DEVICE = "cuda"
SUFFIXES = {"hidden": "model.norm", "q": "self_attn.q_norm", "k": "self_attn.k_norm", "gated": "linear_attn.norm"}
ROW = "{:>6} {:>7} {:>6} {:>7} {:>11} {:>11} {:>11} {:>11} {:>6} {:>8} {:>8}"


def parse_args() -> argparse.Namespace:
    """The rows and the model shapes to run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="sequences decoding (default 64 256)")
    names = [name for name in MODELS if name != "tiny"]
    parser.add_argument("--models", nargs="+", default=names, choices=names, help="model shapes (default all)")
    return parser.parse_args()


def step_norms(name: str) -> list[tuple[str, torch.nn.Module, int, int]]:
    """(kind, a norm module of the model (on the meta device), rows per sequence, calls per decode step) of
    each norm kind the model has."""
    class_name, overrides = MODELS[name]
    config = getattr(transformers, class_name)(**overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = config.num_hidden_layers
    attention = layers - (getattr(config, "layer_types", None) or []).count("linear_attention")
    first = {}
    for key, module in model.named_modules():
        kind = next((k for k, suffix in SUFFIXES.items() if key.endswith(suffix)), None)
        first.setdefault(kind, module)
    rows = {"hidden": (1, 2 * layers + 1), "q": (config.num_attention_heads, attention),
            "k": (config.num_key_value_heads, attention),
            "gated": (getattr(config, "linear_num_value_heads", 0), layers - attention)}
    return [(kind, first[kind], *rows[kind]) for kind in SUFFIXES if kind in first]


def time_norm(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> tuple:
    """The module's forward and its fused twin's, timed; the largest difference of their outputs."""
    twin = copy.deepcopy(module)
    assert fuse_norms(twin), f"{type(module).__name__} is not fused"
    args = (x,) if gate is None else (x, gate)
    diff = (twin(*args).float() - module(*args).float()).abs().max().item()
    return time_call(lambda: module(*args)), time_call(lambda: twin(*args)), diff


def run_model(name: str, rows: list[int], copy_gbs: float) -> None:
    """Time each norm kind both ways at each row count; print a row each and the step's totals."""
    totals = {seqs: [0.0, 0.0] for seqs in rows}
    for kind, meta, per_seq, calls in step_norms(name):
        module = copy.deepcopy(meta).to_empty(device=DEVICE).to(torch.bfloat16)
        torch.nn.init.normal_(module.weight, 1.0, 0.1)
        width = module.weight.shape[0]
        for seqs in rows:
            x = torch.randn(seqs * per_seq, width, device=DEVICE, dtype=torch.bfloat16)
            hf, ours, diff = time_norm(module, x, torch.randn_like(x) if kind == "gated" else None)
            gbs = (3 if kind == "gated" else 2) * x.numel() * x.element_size() / ours.ms / 1e6
            print(ROW.format(seqs, kind, width, calls, *hf.cells(), *ours.cells(), f"{gbs:.0f}",
                             f"{gbs / copy_gbs:.0%}", f"{diff:.1e}"))
            totals[seqs][0] += calls * hf.ms
            totals[seqs][1] += calls * ours.ms
    for seqs, (hf_ms, ours_ms) in totals.items():
        print(f"    {name}, {seqs} sequences: a decode step's norms take {hf_ms:.2f} ms as transformers' modules, "
              f"{ours_ms:.2f} ms fused (graph replay; eager where a way cannot be captured)")


def main() -> None:
    """Check for a GPU, measure the copy bandwidth, print the table per model."""
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_norm.py needs a CUDA GPU; on the CPU the kernel is tested (tests/test_fused_norm.py)")
    copy_gbs = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; bfloat16; times in us")
    print(ROW.format("seqs", "norm", "width", "calls", "hf graph", "hf eager", "fused graph", "fused eager",
                     "GB/s", "of copy", "diff"))
    for name in args.models:
        run_model(name, args.rows, copy_gbs)


if __name__ == "__main__":
    main()

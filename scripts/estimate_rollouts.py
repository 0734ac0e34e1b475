"""Estimate how long this engine's whole rollouts_N runs take on a GPU, without one, to plan device calls.

The real engine runs each workload on the CPU, on a one-layer tiny model, at 1/--scale of its prompt and
new tokens, KV cache and CPU pool (the same 256 samples; a step's budget is one token per sample plus
1024/--scale, the default 1024 scaled), and records per step the decoding sequences, their context and
the prefill (or recompute) tokens. Each step is then costed on the card: (weights + KV read) /
--bandwidth-gbs, the effective rate of a measured decode step, plus --prefill-us per prefill token (given
for the Qwen3-1.7B shape, scaled by weight bytes for others). Weights and KV bytes per token come from
scripts/bench_gpu.py's model shapes in bfloat16; the cache from --card-gib as the engine sizes it
(--memory-utilization of the card less weights and --peak-gib), the pool from --offload-gib.

Defaults are an H100 80GB as measured on 2026-11-24 (decode at 2.08 TB/s effective); with them the
estimate of rollouts_1024 on qwen3-1.7b is 13 s, against 13.6 s measured. Figures mean nothing beyond
that model: the benchmark is scripts/bench_gpu.py.

Example: python scripts/estimate_rollouts.py --models qwen3-1.7b llama-3.1-8b --workloads rollouts_4096
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_runs import BLOCK_SIZE, MODELS, WORKLOADS  # noqa: E402

DENSE = [m for m in MODELS if m not in ("tiny", "qwen3.5")]  # the estimate's KV and step costs are a dense model's

from rollout import SamplingParams  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.tiny_models import build_tiny_model  # noqa: E402

ROLLOUTS = [name for name in WORKLOADS if name.startswith("rollouts_")]
QWEN_WEIGHT_BYTES = 3.44e9  # --prefill-us is given for this shape


def build_tiny(path: str | Path) -> Path:
    """The one-layer model the scaled runs use (its cost is not what is estimated, only its steps)."""
    return build_tiny_model(path, "qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            max_position_embeddings=32768)


def kv_bytes_per_token(config: transformers.PretrainedConfig, itemsize: int) -> int:
    """KV bytes of one token across every layer of a dense model with `config`."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * itemsize


@functools.cache
def shape(model: str) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of bench_gpu's `model` in bfloat16."""
    config_cls, values = MODELS[model]
    config = getattr(transformers, config_cls)(**values)
    with torch.device("meta"):
        weights = sum(p.numel() * 2 for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    return weights, kv_bytes_per_token(config, 2)


def simulate(tiny: Path, workload: str, cache_tokens: int, pool_tokens: int, scale: int) -> tuple[list, dict]:
    """Run `workload` at 1/`scale` on the CPU; returns per step (decodes, their context, prefill tokens),
    and the engine's counters."""
    w = WORKLOADS[workload]
    pool_blocks = pool_tokens // scale // BLOCK_SIZE
    bytes_per_block = BLOCK_SIZE * kv_bytes_per_token(transformers.AutoConfig.from_pretrained(tiny), 4)
    engine = Engine(EngineConfig(model=str(tiny), num_blocks=cache_tokens // scale // BLOCK_SIZE,
                                 cpu_offload_gib=(pool_blocks + 0.5) * bytes_per_block / 2**30,
                                 max_num_seqs=w.prompts * w.n, max_batch_tokens=w.prompts * w.n + 1024 // scale))
    log, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        decodes = batch.seqs[:batch.num_decodes]
        log.append((len(decodes), sum(s.num_computed_tokens + 1 for s in decodes),
                    sum(batch.num_tokens) - len(decodes)))
        return batch

    engine.scheduler.schedule = recording_schedule
    prompts = [[3 + i] * (w.prompt_len // scale) for i in range(w.prompts)]
    engine.generate(prompts, SamplingParams(n=w.n, max_new_tokens=w.new_tokens // scale, ignore_eos=True, seed=0))
    return log, engine.stats()


def cost(log: list, weights: int, kv_per_token: int, args: argparse.Namespace) -> float:
    """Seconds of the recorded steps on the card: each scaled step stands for `scale` steps."""
    seconds, scale = 0.0, args.scale
    prefill_s = args.prefill_us * 1e-6 * weights / QWEN_WEIGHT_BYTES
    for _, context, prefill in log:
        seconds += scale * (weights + context * scale * kv_per_token) / (args.bandwidth_gbs * 1e9)
        seconds += scale * prefill * prefill_s
    return seconds


def cache_bytes(model: str, args: argparse.Namespace) -> float:
    """The KV cache the engine would size on the card beside `model`'s weights and the activation peak."""
    return (args.card_gib * args.memory_utilization - args.peak_gib) * 2**30 - shape(model)[0]


def estimate(tiny: Path, model: str, workload: str, args: argparse.Namespace) -> dict:
    """The estimated whole run of `workload` on `model`: cache and pool sizes, seconds, tokens/s, and the
    offloads and recomputes of the scaled run."""
    weights, kv_per_token = shape(model)
    cache_tokens = int(cache_bytes(model, args) // kv_per_token)
    pool_tokens = int(args.offload_gib * 2**30 // kv_per_token)
    log, stats = simulate(tiny, workload, cache_tokens, pool_tokens, args.scale)
    seconds = cost(log, weights, kv_per_token, args)
    return {"cache_tokens": cache_tokens, "pool_tokens": pool_tokens, "seconds": seconds,
            "tokens_per_s": WORKLOADS[workload].tokens / seconds, "offloads": stats["offloads"],
            "recomputes": stats["recomputes"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options, checked before any work."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=DENSE, default=["qwen3-1.7b"],
                        help="bench_gpu's model shapes to cost (default qwen3-1.7b)")
    parser.add_argument("--workloads", nargs="+", choices=ROLLOUTS, default=ROLLOUTS[:4],
                        help=f"workloads (default {' '.join(ROLLOUTS[:4])}; rollouts_16384 takes minutes)")
    parser.add_argument("--scale", type=int, default=16, help="lengths, cache and pool divided by this (default 16)")
    parser.add_argument("--card-gib", type=float, default=79.19, help="the card's memory (default 79.19: H100)")
    parser.add_argument("--memory-utilization", type=float, default=0.9, help="the engine's default 0.9")
    parser.add_argument("--peak-gib", type=float, default=3.0, help="activation peak the engine profiles (3)")
    parser.add_argument("--offload-gib", type=float, default=16.0, help="CPU pool, as bench_gpu's (default 16)")
    parser.add_argument("--bandwidth-gbs", type=float, default=2080.0, help="effective decode GB/s (2080)")
    parser.add_argument("--prefill-us", type=float, default=20.0, help="us per prefill token, Qwen3-1.7B (20)")
    args = parser.parse_args(argv)
    for name in ("scale", "card_gib", "memory_utilization", "bandwidth_gbs", "prefill_us"):
        if not 0 < getattr(args, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a finite number > 0")
    for name in ("peak_gib", "offload_gib"):
        if not 0 <= getattr(args, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a finite number >= 0")
    if args.memory_utilization > 1:
        parser.error(f"--memory-utilization={args.memory_utilization} must be at most 1")
    if args.scale > 256 or 256 % args.scale:
        parser.error(f"--scale={args.scale} must divide the prompt length 256")
    for model in args.models:
        if cache_bytes(model, args) <= 0:
            parser.error(f"--card-gib={args.card_gib} x --memory-utilization={args.memory_utilization} - --peak-gib="
                         f"{args.peak_gib} leaves no KV cache beside {model}'s {shape(model)[0] / 2**30:.1f} GiB of "
                         "weights")
    return args


def main() -> None:
    """Cost every model x workload on the tiny stand-in model and print a row each."""
    args = parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<14}{'workload':<16}{'cache tok':>10}{'pool tok':>10}{'seconds':>9}{'tok/s':>8}"
          f"{'offloads':>10}{'recomputes':>12}")
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build_tiny(scratch)
        for model in args.models:
            for workload in args.workloads:
                r = estimate(tiny, model, workload, args)
                print(f"{model:<14}{workload:<16}{r['cache_tokens']:>10}{r['pool_tokens']:>10}{r['seconds']:>9.0f}"
                      f"{r['tokens_per_s']:>8.0f}{r['offloads']:>10}{r['recomputes']:>12}")


if __name__ == "__main__":
    main()

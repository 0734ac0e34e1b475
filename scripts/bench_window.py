"""CPU rollout benchmark of sliding-window layers kept in rings (windowed_kv="window", what "auto" picks here)
against the same engine keeping every token of every layer (windowed_kv="full", its previous version) and
transformers `generate`, one run.

Model: a tiny random gpt-oss-shaped model (hidden 256, 4 layers alternating window-128 and full attention,
8 query and 2 KV heads of 64, attention sinks, 4 experts of which 2 per token, vocab 4096).
Workloads: "cpu-window-rollout": 4 prompts of 32-160 tokens, n = 8, 1024 new tokens, eos ignored, temperature
1, engines built with the defaults, `generate` with its best batch of 4, 8 or 16 prompts per call;
"pressure": the same requests, both engines at max_num_seqs 32 (the workload's samples) and one memory budget
(kv_cache_memory_gib, which the rings come out of): a quarter, and then a half, of what the full cache needs
for all of them (recompute only, the default; max_model_len the longest sample). "auto" picks rings where
they cost no capacity, printed per budget.
Usage: python scripts/bench_window.py [--prompts 4] [--n 8] [--new-tokens 1024] [--repeats 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import tempfile

import bench_cpu as cpu

from rollout.config import EngineConfig
from workers.engine import Engine
from workers.engine.tiny_models import build_tiny_model

GPT_OSS = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
               initializer_range=0.02, max_position_embeddings=32768, sliding_window=128, num_local_experts=4,
               num_experts_per_tok=2)
FULL = "engine, every token kept (previous version)"


def bench_pressure(path: str, prompts: list[list[int]], args: argparse.Namespace) -> list[tuple[str, float, dict]]:
    """Both engines in one memory budget, a quarter and a half of the full cache's need (each sample's own
    blocks, the prompt's shared), but at least two longest samples and the rings' rows."""
    probe = dict(model=path, num_blocks=8, max_num_seqs=len(prompts) * args.n, max_model_len=cpu.longest(prompts, args))
    full = Engine(EngineConfig(**probe, windowed_kv="full")).runner
    window = Engine(EngineConfig(**probe, windowed_kv="window")).runner
    per_token = full.bytes_per_block / full.block_size
    need = sum(len(p) + args.n * args.new_tokens for p in prompts) * per_token
    print(f"KV bytes per token: {per_token:.0f} full, {window.bytes_per_block / window.block_size:.0f} paged, and "
          f"rings of {window.ring_tokens} tokens per row ({window.states.nbytes / 2**20:.1f} MiB for "
          f"{window.states.num_slots} rows); the workload needs {need / 2**20:.1f} MiB kept whole", flush=True)
    rows = []
    floor = 2 * cpu.longest(prompts, args) * per_token + window.states.nbytes  # a small workload's share holds less
    for share in (4, 2):
        gib = max(need / share, floor) / 2**30
        auto = Engine(EngineConfig(**{**probe, "num_blocks": None}, kv_cache_memory_gib=gib)).runner.layout.rings
        floored = " (raised to two longest samples and the rings)" if gib * 2**30 > need / share else ""
        print(f"1/{share} of the need: {gib:.4f} GiB{floored}; auto picks {'rings' if auto else 'every token'}",
              flush=True)
        for label, mode in (("rings", "window"), ("every token kept", "full")):
            rows.append((f"1/{share}: {label}", *cpu.capped_run(path, prompts, args, gib, windowed_kv=mode,
                                                                max_num_seqs=len(prompts) * args.n)))
    return rows


def main() -> None:
    """Build the model, time both engines and `generate` in interleaved rounds, then under memory pressure,
    and print the tables."""
    args = cpu.rollout_parser(__doc__, prompts=4, new_tokens=1024, repeats=2).parse_args()
    prompts = cpu.make_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "gpt_oss", **GPT_OSS))
        others = {FULL: cpu.engine_run(path, prompts, args.n, args.new_tokens, windowed_kv="full")}
        results = cpu.rollout_rounds(path, prompts, args, others)
        pressure = bench_pressure(path, prompts, args)
    cpu.print_rollout(results, args, "cpu-window-rollout")
    cpu.print_pressure(pressure, "the same requests, one memory budget per pair: a share of the full cache's need")


if __name__ == "__main__":
    main()

"""CPU rollout benchmark of multi-head latent attention: the engine caching each token's latent against
the engine caching expanded keys and values (its previous version) and transformers `generate`, one run.

Model: a tiny random DeepSeek-V2-shaped model (hidden 256, 4 layers, 8 heads, kv_lora_rank 64, rotary key
16, non-rotary key 32, values 32, dense MLPs, vocab 4096): its cache holds 80 numbers per token and layer
as the latent, 8 heads x 48 x 2 = 768 expanded (DeepSeek-V2-Lite's ratio is 576 to 6,144).
Workloads: "cpu-latent-rollout": 16 prompts of 32-160 tokens, n = 8, 128 new tokens, eos ignored,
temperature 1, engines built with the defaults, `generate` with its best batch of 4, 8 or 16 prompts per
call; "pressure": the same requests with `kv_cache_memory_gib` set to a quarter of what the expanded cache
needs for all of them (at least two of the longest samples), both engines (recompute only: the default;
max_model_len the longest sample).
Usage: python scripts/bench_latent.py [--prompts 16] [--n 8] [--new-tokens 128] [--repeats 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from unittest import mock

from bench_cpu import (
    capped_run,
    engine_run,
    longest,
    make_prompts,
    print_pressure,
    print_rollout,
    rollout_parser,
    rollout_rounds,
)

from rollout.config import EngineConfig
from workers.engine import Engine, latent
from workers.engine.tiny_models import build_tiny_model

MLA = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8, initializer_range=0.02,
           max_position_embeddings=32768, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
           qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=4)
EXPANDED = "engine, expanded K/V (previous version)"


def expanded_kv() -> contextlib.AbstractContextManager:
    """While open, engines built cache expanded keys and (padded) values, as before the latent cache."""
    return mock.patch.object(latent, "_is_latent_attention", lambda module: False)


def bench_pressure(path: str, prompts: list[list[int]], args: argparse.Namespace) -> list[tuple[str, float, dict]]:
    """Both caches under a budget of a quarter of the expanded cache's need (each sample's own blocks, the
    prompt's shared), and at least two of the longest samples."""
    with expanded_kv():
        per_token = Engine(EngineConfig(model=path, num_blocks=8)).runner.bytes_per_block / 16
    need = sum(len(p) + args.n * args.new_tokens for p in prompts) * per_token
    gib = max(need / 4, 2 * longest(prompts, args) * per_token) / 2**30
    with expanded_kv():
        expanded = capped_run(path, prompts, args, gib)
    return [("latent (default)", *capped_run(path, prompts, args, gib)), ("expanded K/V", *expanded)]


def main() -> None:
    """Build the model, time both engines and `generate` in interleaved rounds, then under memory pressure,
    and print the tables."""
    args = rollout_parser(__doc__, prompts=16, new_tokens=128, repeats=2).parse_args()
    prompts = make_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "deepseek_v2", **MLA))
        with expanded_kv():
            others = {EXPANDED: engine_run(path, prompts, args.n, args.new_tokens)}
        results = rollout_rounds(path, prompts, args, others)
        pressure = bench_pressure(path, prompts, args)
    print_rollout(results, args, "cpu-latent-rollout")
    print_pressure(pressure, "the same requests, KV cache capped at a quarter of the expanded cache's need")


if __name__ == "__main__":
    main()

"""CPU rollout benchmark of a linear-attention hybrid: this engine vs transformers `generate` and
`generate_batch`, one run.

Workload "cpu-hybrid-rollout": a tiny random Qwen3.5-shaped model (hidden 256, 4 layers, three Gated
DeltaNet layers to one attention layer, vocab 4096), 16 prompts of 32-160 tokens, n = 8, 64 new tokens,
eos ignored, temperature 1, on an engine built with the defaults (`EngineConfig(model=...)`) against
`generate` with its best batch of 4, 8 or 16 prompts per call, and `generate_batch` where transformers'
continuous batching takes the model. Every linear-attention layer runs transformers' reference PyTorch
code in both (no flash-linear-attention here), so the table compares the batching around it.
Usage: python scripts/bench_hybrid.py [--prompts 16] [--n 8] [--new-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from bench_cpu import MODEL, bench_generate_batch, best_generate, engine_run, make_prompts

from workers.engine.tiny_models import build_tiny_model

# Qwen3.5's layer pattern and Gated DeltaNet heads, scaled down with the attention layers of bench_cpu's model
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)


def main() -> None:
    """Build the model, time each system over `--rounds` rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout (default 16)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per sample (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per system (default 2)")
    args = parser.parse_args()
    path = str(build_tiny_model(tempfile.mkdtemp(), "qwen3_5_text", **MODEL, **HYBRID))
    prompts = make_prompts(args.prompts)
    label, generate = best_generate(path, prompts, args.n, args.new_tokens)
    systems = {"this engine (defaults)": engine_run(path, prompts, args.n, args.new_tokens), label: generate}
    results = {name: [run() for _ in range(args.rounds)] for name, run in systems.items()}
    try:
        results["transformers generate_batch"] = [bench_generate_batch(path, prompts, args.n, args.new_tokens)]
    except Exception as err:  # noqa: BLE001 - reported in the table, whatever transformers raises
        print(f"transformers generate_batch failed: {type(err).__name__}: {err}")
    base = statistics.median(results[label])
    print(f"\ncpu-hybrid-rollout: {args.prompts} prompts x n={args.n} x {args.new_tokens} new tokens, "
          f"{args.rounds} rounds")
    print(f"{'system':<56}{'tokens/s':>10}{'vs generate':>13}")
    for name, values in results.items():
        mid = statistics.median(values)
        print(f"{name:<56}{mid:>10.0f}{mid / base:>12.2f}x")


if __name__ == "__main__":
    main()

"""CPU rollout benchmark of a linear-attention hybrid: this engine vs transformers `generate` and
`generate_batch`, one run.

Workload "cpu-hybrid-rollout": a tiny random Qwen3.5-shaped model (hidden 256, 4 layers, three Gated
DeltaNet layers to one attention layer, vocab 4096), 16 prompts of 32-160 tokens, n = 8, 64 new tokens,
eos ignored, temperature 1, on an engine built with the defaults (`EngineConfig(model=...)`) against
`generate` with its best batch of 4, 8 or 16 prompts per call, and `generate_batch` where transformers'
continuous batching takes the model. Every linear-attention layer runs transformers' reference PyTorch
code in both (no flash-linear-attention here), so the table compares the batching around it.
Usage: python scripts/bench_hybrid.py [--prompts 16] [--n 8] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile

from bench_cpu import MODEL, make_prompts, print_rollout, rollout_rounds

from workers.engine.tiny_models import build_tiny_model

# Qwen3.5's layer pattern and Gated DeltaNet heads, scaled down with the attention layers of bench_cpu's model
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)


def main() -> None:
    """Build the model, time the engine and `generate` in interleaved rounds, then `generate_batch`, and
    print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout (default 16)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per sample (default 64)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds of engine and generate (default 2)")
    args = parser.parse_args()
    args.skip_hf = False
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "qwen3_5_text", **MODEL, **HYBRID))
        results = rollout_rounds(path, make_prompts(args.prompts), args)
    print_rollout(results, args, "cpu-hybrid-rollout")


if __name__ == "__main__":
    main()

"""CPU rollout benchmark of a linear-attention hybrid: this engine vs transformers `generate` and
`generate_batch`, one run.

Workload "cpu-hybrid-rollout": a tiny random Qwen3.5-shaped model (hidden 256, 4 layers, three Gated
DeltaNet layers to one attention layer, vocab 4096), 16 prompts of 32-160 tokens, n = 8, 64 new tokens,
eos ignored, temperature 1, on an engine built with the defaults (`EngineConfig(model=...)`) against
`generate` with its best batch of 4, 8 or 16 prompts per call, and `generate_batch` where transformers'
continuous batching takes the model. Every linear-attention layer runs transformers' reference PyTorch
code in both (no flash-linear-attention here), so the table compares the batching around it.
Usage: python scripts/bench_hybrid.py [--prompts 16] [--n 8] [--new-tokens 64] [--repeats 2] [--skip-hf]
"""

from __future__ import annotations

import tempfile

from bench_cpu import MODEL, make_prompts, print_rollout, rollout_parser, rollout_rounds

from workers.engine.tiny_models import build_tiny_model

# Qwen3.5's layer pattern and Gated DeltaNet heads, scaled down with the attention layers of bench_cpu's model
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)


def main() -> None:
    """Build the model, time the engine and `generate` in interleaved rounds, then `generate_batch`, and
    print the table."""
    args = rollout_parser(__doc__, prompts=16, new_tokens=64, repeats=2).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "qwen3_5_text", **MODEL, **HYBRID))
        results = rollout_rounds(path, make_prompts(args.prompts), args)
    print_rollout(results, args, "cpu-hybrid-rollout")


if __name__ == "__main__":
    main()

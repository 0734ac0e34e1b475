"""bfloat16 agreement of a multi-head latent attention model's samples with a plain transformers forward,
latent cache against expanded K/V: how often the engine's greedy token is the forward's argmax, and how far
its logprob is from the forward's, over 8 prompts x 24 tokens on the CPU.

Usage: python scripts/latent_agreement.py MODEL_DIR [MODEL_DIR ...]   (e.g. a DeepSeek-V2-Lite checkpoint, or
bench_latent.py's model, built with `build_tiny_model(DIR, "deepseek_v2", **bench_latent.MLA)`)
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from unittest import mock

import torch
import transformers

from rollout import SamplingParams
from rollout.config import EngineConfig
from workers.engine import Engine, latent

PROMPT_LENGTHS = [3, 26, 40, 5, 37, 60, 90, 12]


def engine_rows(path: str, use_latent: bool, prompts: list[list[int]]) -> list[dict]:
    """Greedy bfloat16 samples (raw logprobs) of an engine caching the latent or expanded K/V."""
    patch = contextlib.nullcontext() if use_latent else mock.patch.object(latent, "_is_latent_attention",
                                                                          lambda module: False)
    with patch:
        engine = Engine(EngineConfig(model=path, dtype="bfloat16", max_batch_tokens=16, max_num_seqs=8,
                                     num_blocks=512))
    if use_latent and not any(getattr(m, "attends_latent", False) for m in engine.runner.model.modules()):
        raise SystemExit(f"{path}: no layer attends from its latent (not multi-head latent attention), so "
                         "there is nothing to compare")
    table = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, logprobs_mode="raw",
                                                    ignore_eos=True))
    return sorted(table.to_pylist(), key=lambda row: row["prompt_index"])


def agreement(path: str, use_latent: bool) -> tuple[float, torch.Tensor]:
    """Share of tokens that are the forward's argmax, and every token's absolute logprob gap."""
    gen = torch.Generator().manual_seed(0)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    top, gaps = [], []
    for prompt, row in zip(prompts, engine_rows(path, use_latent, prompts)):
        tokens = row["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        logprobs = torch.log_softmax(logits.double(), -1)
        got = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        top.append(logprobs.max(-1).values - got <= 1e-9)
        gaps.append((torch.tensor(row["logprobs"], dtype=torch.float64) - got).abs())
    return torch.cat(top).double().mean().item(), torch.cat(gaps)


def main() -> None:
    """Print one row per model and cache."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model directories with multi-head latent attention")
    args = parser.parse_args()
    for path in args.models:
        if not (Path(path) / "config.json").is_file():
            parser.error(f"{path!r} is not a model directory (no config.json)")
    print(f"{'model':<40}{'cache':<10}{'argmax':>8}{'median':>9}{'mean':>9}{'max':>8}")
    for path in args.models:
        for use_latent in (True, False):
            share, gaps = agreement(path, use_latent)
            print(f"{path:<40}{'latent' if use_latent else 'expanded':<10}{share:>8.3f}{gaps.median():>9.4f}"
                  f"{gaps.mean():>9.4f}{gaps.max():>8.3f}")


if __name__ == "__main__":
    main()

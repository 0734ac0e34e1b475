"""CPU rollout benchmark: this engine vs transformers `generate` and `generate_batch`, one run.

Workload "cpu-rollout": a tiny random Qwen3-shaped model (hidden 256, 4 layers, 8 heads, 2 KV heads,
vocab 4096), 32 prompts of 32-160 tokens, n = 8, 128 new tokens, eos ignored, temperature 1.
Also reports the engine's own overhead per decode step with 256 running sequences and the model
forward replaced by a stub, and the "pressure" workload: 8 prompts, n = 8, 512 new tokens, eos
ignored, with the KV cache at ~25% of what the workload needs, run with CPU offload, with
recompute only, and with a roomy cache.
Usage: python scripts/bench_cpu.py [--prompts 32] [--skip-hf] [--skip-pressure]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

from rollout import SamplingParams
from workers.engine import Engine, EngineConfig
from workers.engine.tiny_models import build_tiny_model

MODEL = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, initializer_range=0.02)


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 161, (count,), generator=gen).tolist()
    return [torch.randint(2, MODEL["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def engine_config(path: str, **overrides) -> EngineConfig:
    defaults = dict(block_size=16, num_blocks=6000, max_batch_tokens=2048, max_num_seqs=256)
    return EngineConfig(model=path, **{**defaults, **overrides})


def bench_engine(path: str, prompts, n: int, new: int) -> float:
    engine = Engine(engine_config(path))
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))
    start = time.perf_counter()
    table = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=new, ignore_eos=True, seed=0))
    elapsed = time.perf_counter() - start
    assert table.num_rows == len(prompts) * n
    return len(prompts) * n * new / elapsed


def hf_generation_config(n: int, new: int) -> transformers.GenerationConfig:
    return transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                         min_new_tokens=new, num_return_sequences=n, eos_token_id=0, pad_token_id=1)


def bench_generate(path: str, prompts, n: int, new: int, prompts_per_batch: int = 4) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = hf_generation_config(n, new)
    start = time.perf_counter()
    for i in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[i:i + prompts_per_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[1] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=config)
    return len(prompts) * n * new / (time.perf_counter() - start)


def bench_generate_batch(path: str, prompts, n: int, new: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=hf_generation_config(n, new))
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return tokens / (time.perf_counter() - start)


def bench_pressure(path: str, new: int = 512) -> list[tuple[str, float, dict]]:
    """(label, tokens/s, stats) for offload, recompute-only and a roomy cache on the same requests."""
    prompts = make_prompts(8, seed=1)
    params = SamplingParams(n=8, max_new_tokens=new, ignore_eos=True, seed=0)
    need = sum(8 * -(-(len(p) + new) // 16) for p in prompts)
    per_block = 4 * 2 * 16 * 2 * 32 * 4
    runs = [("offload (cache 25%)", need // 4, need * per_block / 2**30),
            ("recompute only (cache 25%)", need // 4, 0.0), ("roomy cache", need + 64, 0.0)]
    out = []
    for label, blocks, gib in runs:
        engine = Engine(engine_config(path, num_blocks=blocks, cpu_offload_gib=gib))
        start = time.perf_counter()
        engine.generate(prompts, params)
        out.append((label, len(prompts) * 8 * new / (time.perf_counter() - start), engine.stats()))
    return out


def bench_step_overhead(path: str, seqs: int = 256, steps: int = 50) -> float:
    """Milliseconds per decode step spent outside the model, with `seqs` sequences decoding."""
    engine = Engine(engine_config(path))
    logits = torch.randn(seqs, engine.vocab_size)
    engine.runner.forward = lambda ids, pos, meta, keep: logits[: len(keep)]
    engine.add_request(list(range(2, 66)), SamplingParams(n=seqs, max_new_tokens=steps + 20, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.running) == seqs
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="number of prompts (default 32)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sample (default 128)")
    parser.add_argument("--skip-hf", action="store_true", help="time only this engine")
    parser.add_argument("--skip-pressure", action="store_true", help="skip the memory-pressure workload")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "qwen3", **MODEL))
        prompts = make_prompts(args.prompts)
        results = {"engine": bench_engine(path, prompts, args.n, args.new_tokens)}
        print(f"engine: {results['engine']:.0f} tokens/s", flush=True)
        if not args.skip_hf:
            results["transformers generate (static batches of 4 prompts)"] = bench_generate(
                path, prompts, args.n, args.new_tokens)
            print(f"generate: {results['transformers generate (static batches of 4 prompts)']:.0f} tokens/s",
                  flush=True)
            results["transformers generate_batch"] = bench_generate_batch(path, prompts, args.n, args.new_tokens)
        overhead = bench_step_overhead(path)
        pressure = [] if args.skip_pressure else bench_pressure(path)
    print(f"\ncpu-rollout: {args.prompts} prompts x n={args.n} x {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'system':<56}{'tokens/s':>10}{'vs generate':>13}")
    base = results.get("transformers generate (static batches of 4 prompts)")
    for name, tps in results.items():
        ratio = f"{tps / base:.2f}x" if base else "-"
        print(f"{name:<56}{tps:>10.0f}{ratio:>13}")
    print(f"engine overhead per decode step, 256 sequences, stub model: {overhead:.2f} ms")
    if pressure:
        print("\npressure: 8 prompts x n=8 x 512 new tokens, KV cache at ~25% of the workload's need")
        print(f"{'cache':<30}{'tokens/s':>10}{'offloads':>10}{'restores':>10}{'recomputes':>12}")
        for label, tps, st in pressure:
            print(f"{label:<30}{tps:>10.0f}{st['offloads']:>10}{st['restores']:>10}{st['recomputes']:>12}")


if __name__ == "__main__":
    main()

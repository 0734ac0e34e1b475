"""CPU rollout benchmark: this engine vs transformers `generate` and `generate_batch`, one run.

Workload "cpu-rollout": a tiny random Qwen3-shaped model (hidden 256, 4 layers, 8 heads, 2 KV heads,
vocab 4096), 32 prompts of 32-160 tokens, n = 8, 128 new tokens, eos ignored, temperature 1, on an
engine built with the defaults (`EngineConfig(model=...)`) against `generate` with its best batch of
4, 8 or 16 prompts per call. Also reports the engine's time per decode step with 256 running
sequences and the model's forward stubbed (with and without the sampler's math) for 256 x 128
tokens, 255 x 1k plus one 16k, 256 x 4k, and 256 x 128 with two stop strings each (their text checked
every token); and the "pressure" workload: 8 prompts, n = 8, 512 new
tokens, eos ignored, with the KV cache at ~25% of what the workload needs, run with CPU offload, with
recompute only, and with a roomy cache.
Usage: python scripts/bench_cpu.py [--prompts 32] [--skip-hf] [--skip-pressure]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
import transformers
from arg_types import positive_int
from bench_gpu_hf import generate_all

from rollout import SamplingParams
from workers.engine import Engine, EngineConfig, model_runner, sampler
from workers.engine.tiny_models import build_tiny_model

GENERATE = "transformers generate (static batches of {} prompts)"
MODEL = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, initializer_range=0.02,
             max_position_embeddings=32768)


def make_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of 32-160 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 161, (count,), generator=gen).tolist()
    return [torch.randint(2, MODEL["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def engine_config(path: str, **overrides: Any) -> EngineConfig:
    """The benchmark's CPU engine: a cache roomy enough for the whole workload unless overridden."""
    defaults = dict(block_size=16, num_blocks=6000, max_batch_tokens=2048, max_num_seqs=256)
    return EngineConfig(model=path, **{**defaults, **overrides})


def engine_run(path: str, prompts: list[list[int]], n: int, new: int, **config: Any) -> Callable[[], float]:
    """A function timing one full rollout on a warm default-built engine (`config` overriding defaults;
    prefix cache cleared first); tokens/s. Prints the cache size and the preemptions so far."""
    engine = Engine(EngineConfig(model=path, **config))
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))
    params = SamplingParams(n=n, max_new_tokens=new, ignore_eos=True, seed=0)

    def once() -> float:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        table = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert table.num_rows == len(prompts) * n
        st = engine.stats()
        print(f"engine: {st['blocks_total']} blocks, preempted so far: {st['offloads']} offloads, "
              f"{st['recomputes']} recomputes", flush=True)
        return len(prompts) * n * new / elapsed

    return once


def hf_generation_config(n: int, new: int) -> transformers.GenerationConfig:
    """`generate` settings matching the engine's workload: n samples of exactly `new` tokens."""
    return transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                         min_new_tokens=new, num_return_sequences=n, eos_token_id=0, pad_token_id=1)


def generate_run(path: str, prompts: list[list[int]], n: int, new: int,
                 prompts_per_batch: int = 4) -> Callable[[], float]:
    """A function timing transformers `generate` over static batches of `prompts_per_batch` prompts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = hf_generation_config(n, new)
    batches = []
    for i in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[i:i + prompts_per_batch]
        width = max(map(len, chunk))
        batches.append((torch.tensor([[1] * (width - len(p)) + p for p in chunk]),
                        torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])))

    def once() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for ids, mask in batches:
                model.generate(ids, attention_mask=mask, generation_config=config)
        return len(prompts) * n * new / (time.perf_counter() - start)

    return once


def bench_generate_batch(path: str, prompts: list[list[int]], n: int, new: int) -> float:
    """tokens/s of transformers' own continuous batching (`generate_batch`) on the workload."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    run = generate_all(model, prompts, hf_generation_config(n, new), None, progress=False)
    tokens = sum(len(o.generated_tokens) for o in run.done if o.error is None)
    if not tokens:
        errors = [o.error for o in run.done if o.error is not None]
        raise RuntimeError(f"no request finished ({len(errors)} failed, the first: {errors[:1]})")
    return tokens / (run.stopped - start)  # the last sample's arrival: not the manager's shutdown after it


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


OVERHEAD_CASES = {"a: 256 x 128": [(128, 256)], "b: 255 x 1k + 1 x 16k": [(1024, 255), (16384, 1)],
                  "c: 256 x 4k": [(4096, 256)], "d: a + 2 stop strings": [(128, 256)]}
STOPS = {"d: a + 2 stop strings": ["</answer>", "Observation:"]}  # the cases whose samples have stop strings


def stub_engine(path: str, groups: list[tuple[int, int]], new_tokens: int, stop: list[str] = ()) -> Engine:
    """An engine with the model's forward stubbed (fixed logits) and the attention's metadata skipped,
    decoding `groups` ((prompt length, samples) pairs) with `new_tokens` left per sample and `stop` strings."""
    seqs = sum(n for _, n in groups)
    longest = max(length for length, _ in groups) + new_tokens + 40
    engine = Engine(engine_config(path, max_model_len=longest, max_num_seqs=seqs))
    stub_forward(engine, seqs)
    for length, n in groups:
        engine.add_request([2 + i % 4000 for i in range(length)],
                           SamplingParams(n=n, max_new_tokens=new_tokens + 20, ignore_eos=True, stop=list(stop)))
    step_until_decoding(engine, seqs)
    return engine


def stub_forward(engine: Engine, rows: int) -> None:
    """Replace the model's forward by fixed random logits (up to `rows` kept rows) and skip the attention's
    metadata, so that a step is the engine's host work (and the sampler's)."""
    logits = torch.randn(1, rows, engine.vocab_size)

    def forward(*args: Any, input_ids: torch.Tensor, logits_to_keep: Any, **kwargs: Any) -> SimpleNamespace:
        kept = input_ids.shape[1] if isinstance(logits_to_keep, int) else len(logits_to_keep)  # int: the graphs'
        return SimpleNamespace(logits=logits[:, :kept])

    engine.runner.model.forward = forward
    engine.runner.backend.prepare_metadata = lambda meta: None  # the attention's own work


def step_until_decoding(engine: Engine, seqs: int) -> None:
    """Step until `seqs` samples run and each has generated two tokens (every prompt prefilled and forked)."""
    while len(engine.scheduler.running) < seqs or any(s.num_generated < 2 for s in engine.scheduler.running):
        engine.step()


def bench_step_overhead(path: str, cases: dict[str, list[tuple[int, int]]], blocks: int = 5,
                        steps: int = 20) -> dict[str, tuple[float, float]]:
    """Milliseconds per decode step of each case with the model's forward stubbed: with the sampler's
    math stubbed too (fixed tokens; what is left is the engine's host work), and with it. Median over
    `blocks` blocks of `steps` steps, the blocks of all cases interleaved, so that the machine's drifting
    speed weighs on every case alike."""
    engines = {name: stub_engine(path, groups, 2 * blocks * steps, STOPS.get(name, ()))
               for name, groups in cases.items()}
    rows = max(engine.config.max_num_seqs for engine in engines.values())
    tokens, logprobs = torch.arange(rows) + 2, torch.zeros(rows)

    def fixed_sample(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens[: len(logits)], logprobs[: len(logits)]

    times: dict[tuple[str, bool], list[float]] = {(name, stub): [] for name in cases for stub in (True, False)}
    try:
        for _, stub, (name, engine) in itertools.product(range(blocks), (True, False), engines.items()):
            model_runner.sample = fixed_sample if stub else sampler.sample
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name, stub].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        model_runner.sample = sampler.sample
    return {name: (statistics.median(times[name, True]), statistics.median(times[name, False])) for name in cases}


def best_generate(path: str, prompts: list[list[int]], n: int, new: int) -> tuple[str, Callable[[], float]]:
    """`generate` with its fastest batch of 4, 8 or 16 prompts per call (one timed call each)."""
    runs = {size: generate_run(path, prompts, n, new, size) for size in (4, 8, 16)}
    speed = {size: run() for size, run in runs.items()}
    print("generate, prompts per call: " + ", ".join(f"{k}: {v:.0f} tokens/s" for k, v in speed.items()), flush=True)
    size = max(speed, key=speed.get)
    return GENERATE.format(size), runs[size]


def rollout_rounds(path: str, prompts: list[list[int]], args: argparse.Namespace,
                   others: dict[str, Callable[[], float]] | None = None,
                   ) -> dict[str, list[float]]:
    """tokens/s of each system (the default engine, `others`, `generate`) over `args.repeats` interleaved
    rounds (the machine's speed drifts)."""
    runs = {"engine (default EngineConfig)": engine_run(path, prompts, args.n, args.new_tokens), **(others or {})}
    if not args.skip_hf:
        name, run = best_generate(path, prompts, args.n, args.new_tokens)
        runs[name] = run
    results: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.repeats):
        for name, once in runs.items():
            results[name].append(once())
            print(f"round {round_ + 1}: {name}: {results[name][-1]:.0f} tokens/s", flush=True)
    if not args.skip_hf:
        try:
            results["transformers generate_batch"] = [bench_generate_batch(path, prompts, args.n, args.new_tokens)]
        except Exception as err:  # noqa: BLE001 - reported, whatever transformers raises (linear attention: ValueError)
            print(f"transformers generate_batch failed: {type(err).__name__}: {err}", flush=True)
    return results


def print_rollout(results: dict[str, list[float]], args: argparse.Namespace, workload: str = "cpu-rollout") -> None:
    """The rollout table: median tokens/s, spread over rounds, and speed-up over `generate`."""
    print(f"\n{workload}: {args.prompts} prompts x n={args.n} x {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved rounds")
    print(f"{'system':<56}{'tokens/s':>10}{'min-max':>14}{'vs generate':>13}")
    peer = next((name for name in results if name.startswith("transformers generate (")), None)
    base = statistics.median(results[peer]) if peer else None
    for name, values in results.items():
        mid = statistics.median(values)
        ratio = f"{mid / base:.2f}x" if base else "-"
        print(f"{name:<56}{mid:>10.0f}{f'{min(values):.0f}-{max(values):.0f}':>14}{ratio:>13}")
    if base:
        per_round = [e / g for e, g in zip(results["engine (default EngineConfig)"], results[peer])]
        print(f"engine / generate per round: {', '.join(f'{r:.2f}x' for r in per_round)}")


def capped_run(path: str, prompts: list[list[int]], args: argparse.Namespace, gib: float, **config: Any,
               ) -> tuple[float, dict]:
    """tokens/s and stats of one rollout (`args`' n and new tokens, eos ignored) on an engine whose KV cache is
    capped at `gib` GiB (`config` adding fields; max_model_len the longest sample: a tiny model's 32768 would
    not fit that cache)."""
    engine = Engine(EngineConfig(model=path, kv_cache_memory_gib=gib, max_model_len=longest(prompts, args), **config))
    params = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return len(prompts) * args.n * args.new_tokens / (time.perf_counter() - start), engine.stats()


def longest(prompts: list[list[int]], args: argparse.Namespace) -> int:
    """Tokens of the workload's longest sample."""
    return max(len(p) for p in prompts) + args.new_tokens


def print_pressure(pressure: list[tuple[str, float, dict]],
                   title: str = "8 prompts x n=8 x 512 new tokens, KV cache at ~25% of the workload's need") -> None:
    """The pressure table: tokens/s and preemption counts per cache size."""
    print(f"\npressure: {title}")
    print(f"{'cache':<30}{'tokens/s':>10}{'offloads':>10}{'restores':>10}{'recomputes':>12}")
    for label, tps, st in pressure:
        print(f"{label:<30}{tps:>10.0f}{st['offloads']:>10}{st['restores']:>10}{st['recomputes']:>12}")


def rollout_parser(doc: str, prompts: int, new_tokens: int, repeats: int) -> argparse.ArgumentParser:
    """The options of a rollout benchmark (prompts, samples, new tokens, rounds, --skip-hf) with its defaults."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=positive_int, default=prompts, help=f"number of prompts (default {prompts})")
    parser.add_argument("--n", type=positive_int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--new-tokens", type=positive_int, default=new_tokens,
                        help=f"tokens generated per sample (default {new_tokens})")
    parser.add_argument("--repeats", type=positive_int, default=repeats,
                        help=f"interleaved rounds of every system (default {repeats})")
    parser.add_argument("--skip-hf", action="store_true", help="time only this engine")
    return parser


def main() -> None:
    """Parse options, build the tiny model, run the benchmarks and print their tables."""
    parser = rollout_parser(__doc__, prompts=32, new_tokens=128, repeats=3)
    parser.add_argument("--skip-pressure", action="store_true", help="skip the memory-pressure workload")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "qwen3", **MODEL))
        results = rollout_rounds(path, make_prompts(args.prompts), args)
        overhead = bench_step_overhead(path, OVERHEAD_CASES)
        pressure = [] if args.skip_pressure else bench_pressure(path)
    print_rollout(results, args)
    print("\nms per decode step, 256 sequences, model stubbed (median of 5 blocks of 20 steps, cases interleaved)")
    print(f"{'case':<26}{'host (sampler stubbed)':>24}{'host / case a':>15}{'with the CPU sampler':>22}")
    base = next(iter(overhead.values()))[0]
    for name, (host, with_sampler) in overhead.items():
        print(f"{name:<26}{host:>24.2f}{host / base:>15.2f}{with_sampler:>22.2f}")
    if pressure:
        print_pressure(pressure)


if __name__ == "__main__":
    main()

"""The service path against the in-process engine on the same cores, in one run.

Workload: bench_cpu's "cpu-rollout" model and prompts (32 prompts of 32-160 tokens, n = 8, eos ignored,
temperature 1) with 64 new tokens. Systems, each built with the defaults a user gets:
  - `Engine.generate` in this process, on its main thread;
  - `rollout.sample` through one worker holding both CPUs (embedded local Ray);
  - `rollout.sample` through two workers of one CPU each.
Each service is timed in rounds interleaved with the in-process engine; the table gives medians.
Usage: python scripts/bench_service.py [--prompts 32] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import rollout
from rollout import SamplingParams
from workers.engine import Engine, EngineConfig
from workers.engine.tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arg_types import positive_int  # noqa: E402
from bench_cpu import MODEL, make_prompts  # noqa: E402

SERVICES = {"rollout.sample, 1 worker x 2 CPUs": dict(num_workers=1, cpus_per_worker=2.0),
            "rollout.sample, 2 workers x 1 CPU": dict(num_workers=2, cpus_per_worker=1.0)}


def timed(run: Callable[[], int]) -> float:
    """tokens/s of one call of `run`, which returns the tokens it generated."""
    start = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - start)


def in_process(path: str, prompts: list[list[int]], params: SamplingParams) -> Callable[[], int]:
    """A warm default engine in this process running the workload (its prompts stay in the prefix
    cache between calls, as they do in the service's workers)."""
    engine = Engine(EngineConfig(model=path))
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))

    def run() -> int:
        return sum(map(len, engine.generate(prompts, params).column("token_ids").to_pylist()))

    return run


def through_service(prompts: list[list[int]], params: SamplingParams) -> Callable[[], int]:
    """`rollout.sample` of the workload on the running service."""

    def run() -> int:
        table = rollout.sample(prompts, n=params.n, max_new_tokens=params.max_new_tokens, ignore_eos=True,
                               seed=params.seed).to_table()
        return sum(map(len, table.column("token_ids").to_pylist()))

    return run


def bench(path: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """tokens/s per round of the in-process engine and each service, interleaved."""
    prompts = make_prompts(args.prompts)
    params = SamplingParams(n=8, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine = in_process(path, prompts, params)
    results: dict[str, list[float]] = {"Engine.generate in process": []}
    for name, sizes in SERVICES.items():
        rollout.init(model=path, device="cpu", dtype="float32", **sizes)
        service = through_service(prompts, params)
        service()  # workers loaded and warm
        results[name] = []
        for round_ in range(args.repeats):
            for label, run in (("Engine.generate in process", engine), (name, service)):
                results[label].append(timed(run))
                print(f"round {round_ + 1}: {label}: {results[label][-1]:.0f} tokens/s", flush=True)
        rollout.shutdown()
    return results


def main() -> None:
    """Parse options, build the model, run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=positive_int, default=32, help="number of prompts (default 32)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per sample (default 64)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved rounds per service (default 3)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        results = bench(str(build_tiny_model(tmp, "qwen3", **MODEL)), args)
    base = statistics.median(results["Engine.generate in process"])
    print(f"\n{args.prompts} prompts x n=8 x {args.new_tokens} new tokens, {torch.get_num_threads()} cores")
    print(f"{'system':<40}{'tokens/s':>10}{'min-max':>14}{'vs in-process':>15}")
    for name, values in results.items():
        mid = statistics.median(values)
        print(f"{name:<40}{mid:>10.0f}{f'{min(values):.0f}-{max(values):.0f}':>14}{mid / base:>14.2f}x")


if __name__ == "__main__":
    main()

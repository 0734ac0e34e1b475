"""Host (CPU-side) cost of an engine step by part, at 64, 256 and 512 running sequences.

A tiny 2-layer Llama (hidden 64, vocab 512) whose forward is stubbed (fixed logits) and whose attention
metadata is skipped, so each step is the engine's host work: n = 8 samples per prompt, decoding with eos
ignored, sampled at temperature 1 on the CPU (the "sampler" column is mostly the sampler's math there; on a GPU
its host side is the launches). Cases: async batching off ("sync") and on, the decode-graph
static-buffer path (run eagerly on the CPU), and two stop strings per sample with async batching off and on.
Each part is timed by wrapping its function (time.perf_counter); the median over interleaved blocks of
steps (the machine's speed drifts). A second table times what a finished sample costs once: its row
(its text decoded) and its share of the Arrow record batch.
Usage: python scripts/bench_host.py [--sizes 64 256 512] [--cases sync stop] [--blocks 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
import timeit
from typing import Any, Callable, Iterator

import torch
from arg_types import positive_int
from bench_cpu import step_until_decoding, stub_forward

from rollout import SamplingParams, schema
from workers.engine import Engine, EngineConfig, engine, graphs, model_runner, scheduler, staging
from workers.engine.tiny_models import build_tiny_model

STOPS = ["</answer>", "Observation:"]
CASES: dict[str, dict[str, Any]] = {
    "sync": {}, "async": {"async_batching": True}, "graphs": {"cuda_graphs": (False, True)},
    "stop": {"stop": STOPS}, "stop+async": {"stop": STOPS, "async_batching": True}}
# part name -> (object, attribute) whose calls it times; "step" is the whole of Engine.step
PARTS: dict[str, tuple[Any, str]] = {
    "step": (Engine, "step"), "schedule": (scheduler.Scheduler, "schedule"),
    "plan_step": (model_runner, "plan_step"), "staging": (staging.Staging, "send"),
    "graph_fill": (graphs.DecodeGraphs, "_fill"), "sampler": (model_runner, "sample"),
    "hold": (Engine, "_hold"), "collect": (Engine, "_collect"), "stop_strings": (engine, "stopped_by_strings")}
PROMPT_TOKENS = 40


@contextlib.contextmanager
def timed(parts: dict[str, tuple[Any, str]], totals: dict[str, float]) -> Iterator[None]:
    """Wrap each part's function so that its seconds add up in `totals[name]`; unwrapped on exit."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in parts.values()]

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timer(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return timer

    for name, (owner, attr, fn) in zip(parts, saved):
        setattr(owner, attr, wrap(name, fn))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def stub_engine(path: str, seqs: int, new_tokens: int, case: dict[str, Any]) -> Engine:
    """An engine decoding `seqs` samples (n = 8) with `new_tokens` left each, its model's forward stubbed."""
    stop = case.get("stop", [])
    config = {key: value for key, value in case.items() if key != "stop"}
    length = PROMPT_TOKENS + new_tokens + 8
    eng = Engine(EngineConfig(model=path, num_blocks=seqs * (length // 16 + 2) + 64, max_batch_tokens=4096,
                              max_num_seqs=seqs, max_model_len=length + 16, **config))
    stub_forward(eng, seqs)
    for p in range(seqs // 8):
        eng.add_request([2 + (i * 7 + p) % 400 for i in range(PROMPT_TOKENS)],
                        SamplingParams(n=8, max_new_tokens=new_tokens, ignore_eos=True, stop=stop, seed=p))
    step_until_decoding(eng, seqs)
    return eng


def step_table(path: str, sizes: list[int], cases: list[str], blocks: int, steps: int) -> dict:
    """Median ms per step of each part, by (case, size); the blocks of every engine interleaved."""
    engines = {(case, size): stub_engine(path, size, 2 * blocks * steps + 16, CASES[case])
               for case in cases for size in sizes}
    times: dict[tuple[str, int], dict[str, list[float]]] = {key: {p: [] for p in PARTS} for key in engines}
    for _ in range(blocks):
        for key, eng in engines.items():
            totals: dict[str, float] = {}
            with timed(PARTS, totals):
                for _ in range(steps):
                    eng.step()
            for part in PARTS:
                times[key][part].append(totals.get(part, 0.0) / steps * 1e3)
    return {key: {p: statistics.median(v) for p, v in parts.items()} for key, parts in times.items()}


def finish_costs(path: str, size: int, new_tokens: int) -> tuple[float, float]:
    """Microseconds per finished sample of `new_tokens` tokens: its row (text decoded), and its share of the
    Arrow record batch of all `size` rows."""
    eng = stub_engine(path, size, new_tokens, {})
    totals: dict[str, float] = {}
    rows: list[dict] = []
    with timed({"rows": (engine, "sample_row")}, totals):
        while eng.has_unfinished():
            rows += eng.step()
    arrow = min(timeit.repeat(lambda: schema.samples_to_batch(rows), number=1, repeat=3))  # the first call pays once
    return totals["rows"] / len(rows) * 1e6, arrow / len(rows) * 1e6


def main() -> None:
    """Parse options, build the tiny model, time the parts and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[64, 256, 512],
                        help="running sequences, multiples of 8: prompts of n = 8 (default 64 256 512)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                        help="engine configurations timed (default: all)")
    parser.add_argument("--blocks", type=positive_int, default=5,
                        help="interleaved blocks per engine, median taken (default 5)")
    parser.add_argument("--steps", type=positive_int, default=10, help="steps per block (default 10)")
    parser.add_argument("--new-tokens", type=positive_int, default=400,
                        help="tokens per sample in the finish table, at least 3 (default 400)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default 1: the parts are small ops)")
    args = parser.parse_args()
    if any(size % 8 for size in args.sizes):  # fewer samples than asked would run, and the set-up wait forever
        parser.error(f"--sizes={args.sizes}: each must be a multiple of 8 (prompts of n = 8)")
    if args.new_tokens < 3:  # the samples must still run once all decode (two tokens each)
        parser.error(f"--new-tokens={args.new_tokens} must be at least 3")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "llama", hidden_size=64, num_layers=2, vocab_size=512))
        table = step_table(path, args.sizes, args.cases, args.blocks, args.steps)
        finish = {size: finish_costs(path, size, args.new_tokens) for size in args.sizes}
    print(f"\nms per decode step by part, model stubbed, torch threads: {torch.get_num_threads()} "
          f"(median of {args.blocks} interleaved blocks of {args.steps} steps); 'step' is the whole step")
    print(f"{'case':<12}{'seqs':>5}" + "".join(f"{part:>13}" for part in PARTS))
    for (case, size), parts in table.items():
        print(f"{case:<12}{size:>5}" + "".join(f"{parts[p]:>13.3f}" for p in PARTS))
    print(f"\nper finished sample of {args.new_tokens} tokens (us): its row with its text, its Arrow share")
    for size, (row_us, arrow_us) in finish.items():
        print(f"{size:>5} samples finishing together: row {row_us:>8.1f}  arrow {arrow_us:>8.1f}")


if __name__ == "__main__":
    main()

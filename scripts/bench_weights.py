"""Weight-update benchmark: the time of one `rollout.update_weights` per transport, two CPU workers, one run.

Model: a random Qwen3-shaped model scaled to ~0.5 GB of float32 weights (hidden 1024, vocab 32000, 5 layers,
16 heads, 8 KV heads, untied embeddings). Each transport makes the weights of a second checkpoint (another
seed) the policy of both workers, in mode "continue" with nothing running:
- object_store: the state dict, put once into Ray's object store, read zero-copy by each worker;
- checkpoint: the second checkpoint's directory (local disk, page cache warm: it was just written);
- broadcast: the state dict over the gloo group of `rollout.init_weight_sync()` (formed once, not timed),
  256 MB buckets; the time includes the copy one worker exports into the object store for replay.
Seconds: median of --repeats updates. GB/s: state-dict bytes / seconds (every worker receives all of them).
Usage: python scripts/bench_weights.py [--repeats 3] [--layers 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import tempfile
import time
from typing import Iterator

from arg_types import positive_int

import rollout
from rollout.params import WeightSource
from trainer_client import RolloutClient
from workers.engine.tiny_models import build_tiny_model
from workers.engine.weights import load_source

MODEL = dict(vocab_size=32000, hidden_size=1024, num_heads=16, num_kv_heads=8, initializer_range=0.02)


def time_updates(source: WeightSource, transport: str | None, versions: Iterator[int], repeats: int,
                 client: RolloutClient) -> float:
    """Median seconds of `repeats` updates; checks that every worker holds each new version."""
    seconds = []
    for _ in range(repeats):
        version = next(versions)
        start = time.perf_counter()
        rollout.update_weights(source, version, transport=transport)
        seconds.append(time.perf_counter() - start)
        assert {s["policy_version"] for s in client.stats().values()} == {version}
    return statistics.median(seconds)


def run(root: str, layers: int, repeats: int) -> tuple[float, dict[str, float]]:
    """Build both checkpoints under `root`, start the service, time every transport; returns (GB, seconds)."""
    old = build_tiny_model(f"{root}/old", "qwen3", num_layers=layers, seed=0, **MODEL)
    new = build_tiny_model(f"{root}/new", "qwen3", num_layers=layers, seed=1, **MODEL)
    state = dict(load_source(new))
    gigabytes = sum(t.nbytes for t in state.values()) / 1e9
    rollout.init(model=str(old), num_workers=2, num_blocks=64, max_num_seqs=8, object_store_memory_gib=3.0)
    try:
        client = RolloutClient.connect(name="rollout", namespace="rollout")
        rollout.init_weight_sync()
        versions = itertools.count(1)
        sources = {"object_store": (state, None), "checkpoint": (str(new), None), "broadcast": (state, "broadcast")}
        return gigabytes, {name: time_updates(source, transport, versions, repeats, client)
                           for name, (source, transport) in sources.items()}
    finally:
        rollout.shutdown()


def main() -> None:
    """Run the benchmark once and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3, help="updates timed per transport (default 3)")
    parser.add_argument("--layers", type=positive_int, default=5,
                        help="decoder layers of the model (default 5: ~0.5 GB of float32 weights)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        gigabytes, seconds = run(root, args.layers, args.repeats)
    print(f"state dict: {gigabytes:.3f} GB float32; 2 CPU workers; {os.cpu_count()} CPUs, {platform.platform()}")
    print("| transport | seconds | GB/s |\n|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {s:.3f} | {gigabytes / s:.2f} |")


if __name__ == "__main__":
    main()

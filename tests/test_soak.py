"""Soak: two CPU workers serve thousands of samples from concurrent callers through a KV cache small enough
that sequences are both offloaded and recomputed, while calls are cancelled at random, the weights are
updated once in "continue" mode, two workers are killed and one hangs. At the end every sample of every
call that was not cancelled arrived exactly once with consistent versions, block accounting held on every
worker after every step, nothing leaked, and the service still answers. Run alone: `pytest -m soak`."""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import pytest
import ray
import torch

import rollout
from tests.conftest import gib_per_block, random_prompts
from tests.test_service_hangs import hang_next_step
from trainer_client import RolloutClient

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

TARGET_SAMPLES = 2000
CALLERS = 3
PROMPTS, N = 6, 4  # per call: 24 samples
STALL_S = 3.0


@dataclass
class Tally:
    """What the callers saw: complete calls' rows, cancelled calls' rows, and calls' start times."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    complete: list[tuple[float, list[dict]]] = field(default_factory=list)
    cancelled: list[list[dict]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def delivered(self) -> int:
        with self.lock:
            return sum(len(rows) for _, rows in self.complete) + sum(len(rows) for rows in self.cancelled)


def caller(seed: int, tally: Tally, stop: threading.Event) -> None:
    """Make sample calls until `stop`: random prompts and lengths, one call in five cancelled part-way."""
    rng = random.Random(seed)
    while not stop.is_set():
        prompts = random_prompts(PROMPTS, 512, (4, 40), seed=rng.randrange(1 << 30))
        started = time.monotonic()
        try:
            stream = rollout.sample(prompts, n=N, max_new_tokens=rng.randint(8, 40), ignore_eos=True,
                                    return_token_versions=True, seed=rng.randrange(1 << 30))
            rows, cancel_after = [], rng.randint(1, 3) if rng.random() < 0.2 else None
            for i, batch in enumerate(stream):
                rows += batch.to_pylist()
                if cancel_after is not None and i + 1 >= cancel_after:
                    stream.cancel()
                    break
        except BaseException as err:  # reported by the test, never swallowed
            with tally.lock:
                tally.errors.append(err)
            return
        with tally.lock:
            (tally.cancelled.append(rows) if cancel_after is not None and len(rows) < PROMPTS * N
             else tally.complete.append((started, rows)))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def busiest_worker(client: RolloutClient, preempted: Counter) -> ray.actor.ActorHandle:
    """The worker owing the most samples, its preemption counters added to `preempted` (it is about to go)."""
    stats = client.stats()
    victim = max(stats, key=lambda w: stats[w]["outstanding"])
    preempted.update({k: stats[victim][k] for k in ("offloads", "recomputes")})
    return ray.get_actor(f"rollout-worker-{victim}", namespace="rollout")


# Run inside a worker (a lambda, so that it is pickled by value): its engine's `check_integrity`, on the
# engine's own thread.
check_integrity = lambda actor: actor.loop.submit(actor.loop.engine.check_integrity).result()  # noqa: E731


def check_rows(tally: Tally, updated_at: float) -> None:
    """Every complete call got each (prompt, sample) once; no cancelled call got one twice; versions are
    0 then 1, never back, and calls started after the update returned are all on version 1."""
    for started, rows in tally.complete:
        keys = sorted((r["prompt_index"], r["sample_index"]) for r in rows)
        assert keys == [(p, s) for p in range(PROMPTS) for s in range(N)], "lost or duplicated samples"
    for rows in tally.cancelled:
        keys = [(r["prompt_index"], r["sample_index"]) for r in rows]
        assert len(set(keys)) == len(keys), "a cancelled call got a sample twice"
    for started, rows in tally.complete:
        for r in rows:
            versions = r["token_policy_versions"]
            assert versions == sorted(versions) and set(versions) <= {0, 1}
            assert (r["first_policy_version"], r["policy_version"]) == (versions[0], versions[-1])
            if started > updated_at:
                assert set(versions) == {1}, "a call started after the update sampled old weights"


def perturbed(model: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    return {name: t + 0.01 * torch.randn_like(t) for name, t in state.items()}


def run_phases(client: RolloutClient, model: str, tally: Tally, preempted: Counter) -> float:
    """Serve from concurrent callers through a kill, a weights update, a hang and a second kill; returns
    when the update returned (inf when it never did)."""
    stop, updated_at = threading.Event(), float("inf")
    threads = [threading.Thread(target=caller, args=(i, tally, stop)) for i in range(CALLERS)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: tally.delivered > TARGET_SAMPLES * 0.2, 300, "the first samples")
        ray.kill(busiest_worker(client, preempted), no_restart=True)
        wait_for(lambda: tally.delivered > TARGET_SAMPLES * 0.4, 300, "samples after the first kill")
        rollout.update_weights(perturbed(model), version=1, mode="continue")
        updated_at = time.monotonic()
        wait_for(lambda: tally.delivered > TARGET_SAMPLES * 0.6, 300, "samples after the update")
        ray.get(busiest_worker(client, preempted).__ray_call__.remote(hang_next_step))
        wait_for(lambda: tally.delivered > TARGET_SAMPLES * 0.8, 300, "samples after the hang")
        ray.kill(busiest_worker(client, preempted), no_restart=True)
        wait_for(lambda: tally.delivered > TARGET_SAMPLES, 300, f"{TARGET_SAMPLES} samples")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    return updated_at


def check_workers(client: RolloutClient, preempted: Counter) -> None:
    """Both killed workers were replaced, every worker is idle with its blocks balanced, nothing left in
    its CPU pool and the new version loaded; offload and recompute both happened."""
    wait_for(lambda: sorted(client.stats()) == [0, 1], 120, "both killed workers to be replaced")
    wait_for(lambda: all(s["running"] + s["waiting"] + s["offloaded"] == 0 for s in client.stats().values()),
             60, "aborted samples to leave the workers")
    stats = client.stats()
    for worker in stats:
        ray.get(ray.get_actor(f"rollout-worker-{worker}", namespace="rollout").__ray_call__.remote(check_integrity))
    for s in stats.values():
        assert s["blocks_free"] + s["blocks_cached"] == s["blocks_total"] and s["cpu_blocks_used"] == 0
        assert s["policy_version"] == 1
        preempted.update({k: s[k] for k in ("offloads", "recomputes")})
    assert preempted["offloads"] and preempted["recomputes"], preempted


def test_soak(model_dir):
    model = model_dir("qwen3")
    rollout.init(model=model, num_workers=2, flush_rows=4, flush_delay_s=0.02, max_num_seqs=8, num_blocks=24,
                 block_size=16, max_batch_tokens=64, cpu_offload_gib=4 * gib_per_block(model, 16),
                 object_store_memory_gib=0.5, check_integrity=True, worker_stall_timeout_s=STALL_S)
    try:
        client = RolloutClient.connect(name="rollout", namespace="rollout")
        tally, preempted, start = Tally(), Counter(), time.monotonic()
        updated_at = run_phases(client, model, tally, preempted)
        assert not tally.errors, "".join(line for err in tally.errors for line in traceback.format_exception(err))
        check_rows(tally, updated_at)
        check_workers(client, preempted)
        again = rollout.sample(random_prompts(2, 512, (4, 8), seed=1), n=2, max_new_tokens=4).to_table()
        assert again.num_rows == 4
        print(f"soak: {tally.delivered} samples ({len(tally.complete)} complete calls, {len(tally.cancelled)} "
              f"cancelled), 2 kills, 1 hang, {preempted['offloads']} offloads, {preempted['recomputes']} recomputes, "
              f"lost 0, duplicated 0, {time.monotonic() - start:.0f} s")
    finally:
        rollout.shutdown()

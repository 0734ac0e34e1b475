"""Hung workers: a worker whose engine loop stops making progress while it has work (a step that never
returns, as one stuck in a collective would; a process stopped by SIGSTOP) is killed after
`worker_stall_timeout_s` and replaced; its samples are resent and every sample arrives exactly once, and the
replacement holds the current weights before it takes work."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

import rollout
from tests.conftest import random_prompts
from trainer_client import RolloutClient

STALL_S = 3.0
PROMPTS = random_prompts(8, 512, (4, 12), seed=21)


@pytest.fixture(scope="module")
def client(model_dir):
    rollout.init(model=model_dir("qwen3"), num_workers=2, flush_rows=2, flush_delay_s=0.01, max_num_seqs=4,
                 num_blocks=64, object_store_memory_gib=0.5, worker_stall_timeout_s=STALL_S)
    rollout.update_weights(model_dir("qwen3", seed=1), version=1)  # what a replacement must receive
    yield RolloutClient.connect(name="rollout", namespace="rollout")
    rollout.shutdown()


def worker_handle(worker: int) -> ray.actor.ActorHandle:
    return ray.get_actor(f"rollout-worker-{worker}", namespace="rollout")


def worker_pid(worker: int) -> int:
    return ray.get(worker_handle(worker).__ray_call__.remote(lambda actor: os.getpid()))


# Run inside a worker (a lambda, so that it is pickled by value): its engine loop thread blocks for good at
# the next step, while the actor's event loop keeps answering.
hang_next_step = lambda actor: setattr(actor.loop.engine, "step", threading.Event().wait)  # noqa: E731


def sample_with_fault(client: RolloutClient, fault) -> tuple[list[dict], int, int]:
    """Sample 8 prompts x 4; once the first batch arrived, `fault(victim)` hits the worker owing the most.
    Returns every row, the victim and its pid before the fault."""
    batches = iter(rollout.sample(PROMPTS, n=4, max_new_tokens=48, ignore_eos=True))
    received = [next(batches)]
    owing = {w: s["outstanding"] for w, s in client.stats().items()}
    victim = max(owing, key=owing.get)
    assert owing[victim] > 0
    pid = worker_pid(victim)
    fault(victim, pid)
    received += list(batches)
    return [row for batch in received for row in batch.to_pylist()], victim, pid


def check_recovered(client: RolloutClient, rows: list[dict], victim: int, old_pid: int) -> None:
    """Every sample exactly once on version 1; the victim replaced by a new process holding version 1."""
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == [
        (p, s) for p in range(8) for s in range(4)]
    assert all(len(r["token_ids"]) == 48 and r["finish_reason"] == "length" for r in rows)
    assert {r["policy_version"] for r in rows} == {1} and {r["first_policy_version"] for r in rows} == {1}
    assert sum(r["worker_id"] == victim for r in rows) < 16  # the survivor made some of the victim's samples
    deadline = time.monotonic() + 60
    while sorted(client.stats()) != [0, 1]:  # the replacement takes work once it holds the weights
        assert time.monotonic() < deadline, "the stalled worker was not replaced"
        time.sleep(0.2)
    assert worker_pid(victim) != old_pid
    assert {s["policy_version"] for s in client.stats().values()} == {1}
    again = rollout.sample(PROMPTS[:2], n=2, max_new_tokens=4).to_table()
    assert again.num_rows == 4 and set(again.column("worker_id").to_pylist()) == {0, 1}
    assert set(again.column("policy_version").to_pylist()) == {1}


@pytest.mark.timeout(120)  # without the watchdog the call would wait for ever
def test_a_step_that_never_returns_gets_its_worker_replaced(client):
    rows, victim, pid = sample_with_fault(
        client, lambda victim, pid: ray.get(worker_handle(victim).__ray_call__.remote(hang_next_step)))
    check_recovered(client, rows, victim, pid)


@pytest.mark.timeout(120)
def test_a_stopped_worker_process_is_replaced(client):
    stopped: list[int] = []

    def stop(victim: int, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        rows, victim, pid = sample_with_fault(client, stop)
        check_recovered(client, rows, victim, pid)
    finally:
        for pid in stopped:  # Ray kills it a few seconds after the service did; never leave it stopped
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

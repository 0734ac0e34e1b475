"""Hung workers: a worker whose engine loop stops making progress while it has work (a step that never
returns, as one stuck in a collective would; a process stopped by SIGSTOP) is killed after
`worker_stall_timeout_s` and replaced; its samples are resent and every sample arrives exactly once, and the
replacement holds the current weights before it takes work."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest
import ray

import rollout
from rollout import SamplingParams
from rollout.config import load_service_config
from rollout.stall_watch import StallWatch
from tests.conftest import random_prompts
from trainer_client import RolloutClient
from workers.actor import RemoteWorker
from workers.messages import PromptGroup

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


class ScriptedWorker:
    """A worker handle whose `progress` probe answers `script(seconds since start)`: (ticks, idle), None for
    never (a stopped process), or an exception to raise; `progressed` is when it last answered progress."""

    def __init__(self, script: Callable[[float], tuple[int, bool] | None | Exception]) -> None:
        self.script, self.progress = script, self
        self.start = self.progressed = time.monotonic()
        self.last: tuple[int, bool] | None = None

    async def remote(self) -> tuple[int, bool]:
        answer = self.script(time.monotonic() - self.start)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            await asyncio.Event().wait()
        if answer[1] or answer != self.last:
            self.progressed = time.monotonic()
        self.last = answer
        return answer


class ScriptedPool:
    """What StallWatch sees of a WorkerPool; `lose` records (worker, handle, reason, when) and puts the worker's
    entry of `replacements` in its place, as the pool's replacement would."""

    def __init__(self, timeout: float, workers: dict[int, ScriptedWorker], load: dict[int, int]) -> None:
        self.config = SimpleNamespace(worker_stall_timeout_s=timeout)
        self.workers, self.load, self.lost, self.replacements = workers, load, [], {}
        self.closed = False

    def lose(self, worker: int, handle: ScriptedWorker, reason: BaseException) -> None:
        self.lost.append((worker, handle, str(reason), time.monotonic()))
        del self.workers[worker]
        if worker in self.replacements:
            self.workers[worker] = self.replacements.pop(worker)


def watch(pool: ScriptedPool, seconds: float) -> None:
    """Run a StallWatch over `pool` for `seconds`."""
    async def run() -> None:
        task = asyncio.create_task(StallWatch(pool).run())
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(run())


def test_the_watch_probes_a_quarter_timeout_apart_and_at_most_5_s():
    """A stall is seen within 1.25 timeouts, and within 5 s after a long timeout."""
    assert StallWatch(ScriptedPool(2.0, {}, {})).period == 0.5
    assert StallWatch(ScriptedPool(300.0, {}, {})).period == 5.0


def test_only_workers_owing_samples_without_progress_are_lost_after_the_timeout(caplog):
    """Progress until 0.6 s then none, with work: lost, named. Idle ones are never lost, nor is a stopped one
    that was idle (or new) and owes nothing; one that was idle, got work and stopped answering is, as is one
    that stopped answering while busy. A probe that raises is logged and the watch goes on."""
    timeout = 1.0
    workers = {0: ScriptedWorker(lambda t: (int(min(t, 0.6) * 100), False)),
               1: ScriptedWorker(lambda t: (3, True)),
               2: ScriptedWorker(lambda t: (3, True) if t < 0.6 else None),
               3: ScriptedWorker(lambda t: (3, True) if t < 0.6 else None),
               4: ScriptedWorker(lambda t: RuntimeError("probe broke")),
               5: ScriptedWorker(lambda t: (int(t * 100), False) if t < 0.6 else None),
               6: ScriptedWorker(lambda t: None)}
    pool = ScriptedPool(timeout, dict(workers), {0: 4, 1: 0, 2: 2, 3: 0, 4: 0, 5: 0, 6: 0})
    with caplog.at_level(logging.WARNING, logger="rollout.stall_watch"):
        watch(pool, 3.5)
    assert sorted(worker for worker, *_ in pool.lost) == [0, 2, 5]
    for worker, handle, reason, when in pool.lost:
        assert handle is workers[worker] and timeout < when - handle.progressed < timeout + 1.0
        assert reason.startswith(f"worker {worker} had work and made no progress for ")
        assert reason.endswith(f"(worker_stall_timeout_s={timeout})")
    assert "stall probe failed: RuntimeError('probe broke')" in caplog.text


def test_a_replacement_under_the_same_id_gets_the_whole_timeout():
    """The stalled worker 0 is replaced by one that does not answer yet: it is not lost at its first probe
    for the progress its predecessor failed to make."""
    timeout = 1.0
    stalled, replacement = ScriptedWorker(lambda t: (7, False)), ScriptedWorker(lambda t: None)
    pool = ScriptedPool(timeout, {0: stalled}, {0: 1})
    pool.replacements[0] = replacement
    watch(pool, 3.5)
    assert [handle for _, handle, *_ in pool.lost] == [stalled, replacement]
    assert pool.lost[1][3] - pool.lost[0][3] > timeout


def test_a_worker_whose_calls_hold_all_its_slots_still_answers_its_probes(client, model_dir):
    """The service's stall probes (and death watch, stats and weight calls) have slots of their own on a worker:
    with every default slot held by a `generate` call (1,000 calls at once in use; 2 here, both stuck behind a
    step that never returns), `progress` is answered at once. It queued behind them, so that at 1,000 calls the
    stall watch killed healthy workers one replacement after another, and no sample arrived."""
    config = load_service_config(model=model_dir("qwen3"), max_num_seqs=4, num_blocks=64)
    worker = RemoteWorker.options(max_concurrency=2, num_cpus=0).remote(config, 9)
    try:
        ray.get(worker.ready.remote())
        ray.get(worker.__ray_call__.remote(hang_next_step))
        params = SamplingParams(max_new_tokens=8)
        calls = [worker.generate.remote(f"c{i}", [PromptGroup(0, [5, 6, 7], [0])], params) for i in range(2)]
        assert ray.get(next(calls[0]), timeout=30) is None  # queued; the second waits to be, behind the hung step
        time.sleep(1.0)
        ticks, idle = ray.get(worker.progress.remote(), timeout=30)
        assert not idle, "the worker has work"
    finally:
        ray.kill(worker)

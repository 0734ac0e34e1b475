"""The pool's choice of worker for a call, over stand-in worker handles (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from rollout import pool as pool_module
from rollout.params import SamplingParams
from rollout.pool import WorkerPool


def pool_of(num_blocks: dict[int, int], load: dict[int, int], calls: list[int]) -> WorkerPool:
    """A pool whose live workers only record which of them was asked to tokenize."""
    def handle(worker: int) -> SimpleNamespace:
        async def tokenize(prompts: list, params: SamplingParams) -> list[list[int]]:
            calls.append(worker)
            return prompts
        return SimpleNamespace(tokenize=SimpleNamespace(remote=tokenize))

    pool = WorkerPool.__new__(WorkerPool)
    pool.workers = {worker: handle(worker) for worker in num_blocks}
    pool.num_blocks, pool.load, pool.replacing, pool.vacant = num_blocks, load, {}, set()
    return pool


def test_prompts_are_validated_by_the_worker_with_the_smallest_cache():
    """Automatic sizing gives GPUs caches of different sizes: a prompt is validated against the smallest,
    even while a larger one is less loaded, so that any worker it is routed to can hold its samples; among
    equal caches the least loaded validates."""
    calls: list[int] = []
    pool = pool_of({0: 512, 1: 384, 2: 384}, {0: 0, 1: 9, 2: 4}, calls)
    assert asyncio.run(pool.tokenize([[5, 6]], SamplingParams(n=8))) == ([[5, 6]], 384)
    assert calls == [2]


def test_prompts_go_to_workers_whose_cache_is_as_large_as_the_one_that_validated_them():
    """A replacement can come up with a smaller cache than the worker that validated a call's prompts: their
    samples (sent or resent) go to the least loaded of the workers at least as large, and to the least loaded
    of all only when none is (whose engine then judges them)."""
    pool = pool_of({0: 512, 1: 384, 2: 448}, {0: 6, 1: 0, 2: 4}, [])
    assert pool.assign({0: 8, 1: 2}, num_blocks=448) == {2: [0], 0: [1]}
    assert pool.load == {0: 8, 1: 0, 2: 12}
    assert pool.assign({2: 8}, num_blocks=1024) == {1: [2]}


def test_a_replacement_that_dies_before_it_takes_work_is_started_again(monkeypatch):
    """A fresh worker killed while it loads (its node lost, an OOM kill) is a lost worker like any: another is
    started under its id; the slot was left empty for good (both slots so: every later call failed)."""
    deaths = [ActorDiedError(), ActorDiedError()]  # the first two replacements die while their engine loads

    async def ready() -> int:
        if deaths:
            raise deaths.pop()
        return 64

    async def alive() -> None:
        await asyncio.Event().wait()

    async def prepare(handle: SimpleNamespace, admit) -> None:
        admit()

    async def respawn(worker: int) -> SimpleNamespace:
        return SimpleNamespace(ready=SimpleNamespace(remote=ready), alive=SimpleNamespace(remote=alive))

    killed: list[SimpleNamespace] = []
    monkeypatch.setattr(pool_module.ray, "kill", lambda handle, no_restart: killed.append(handle))
    pool = pool_of({1: 64}, {1: 0}, [])
    pool.starting, pool.watches, pool.prepare, pool.closed = {}, {}, prepare, False
    pool._respawn = respawn

    async def lose_and_wait() -> None:
        pool.lose(1, pool.workers[1], ActorDiedError())
        await pool.wait_replacements()
        pool.watches[1].cancel()
    asyncio.run(lose_and_wait())
    assert list(pool.workers) == [1] and pool.load == {1: 0} and not pool.starting
    assert len(killed) == 3  # the lost worker and both dead replacements


def test_prompts_are_routed_largest_demand_first():
    """A resend after a loss asks for different numbers of samples per prompt: the largest goes first, so that
    the smaller ones even out the load around it (in call order the large one would pile on a loaded worker)."""
    pool = pool_of({0: 64, 1: 64}, {0: 0, 1: 0}, [])
    assert pool.assign({0: 1, 1: 1, 2: 8}, num_blocks=64) == {0: [2], 1: [0, 1]}
    assert pool.load == {0: 8, 1: 2}


def test_call_all_raises_a_workers_error_and_leaves_a_lost_worker_out(monkeypatch):
    """`call_all` (a weight update on every worker) raises the error one worker's call raised once every call
    has ended, never returns as if all had succeeded; a worker lost meanwhile is left out of the results."""
    def handle(outcome: object) -> SimpleNamespace:
        async def update_weights(version: int) -> int:
            if isinstance(outcome, BaseException):
                raise outcome
            return version
        return SimpleNamespace(update_weights=SimpleNamespace(remote=update_weights))

    monkeypatch.setattr(pool_module.ray, "kill", lambda handle, no_restart: None)
    pool = pool_of({0: 64, 1: 64, 2: 64}, {0: 0, 1: 0, 2: 0}, [])
    pool.closed = True  # a lost worker is not replaced
    pool.workers = {0: handle(None), 1: handle(ActorDiedError()), 2: handle(OSError("checkpoint unreadable"))}
    with pytest.raises(OSError, match="checkpoint unreadable"):
        asyncio.run(pool.call_all("update_weights", 3))
    assert list(pool.workers) == [0, 2]
    del pool.workers[2]
    assert asyncio.run(pool.call_all("update_weights", 4)) == {0: 4}


def test_a_pending_placement_is_logged_then_fails_naming_what_the_cluster_has_free(monkeypatch, caplog):
    """A placement the cluster could not hold waited the whole `placement_timeout_s` (10 minutes in
    cluster.toml) in silence, and the error then gave the cluster's total, not what was free."""
    monkeypatch.setattr(pool_module, "PLACEMENT_LOG_S", 0.2)
    monkeypatch.setattr(pool_module.ray, "cluster_resources", lambda: {"CPU": 4.0, "memory": 1e9})
    monkeypatch.setattr(pool_module.ray, "available_resources", lambda: {"memory": 1e9})
    pool = WorkerPool.__new__(WorkerPool)
    pool.size = 1
    pool.config = SimpleNamespace(placement_timeout_s=0.5, placement_strategy="PACK")
    pool.placement = SimpleNamespace(bundle_specs=[{"CPU": 1.0}], ready=lambda: asyncio.Event().wait())
    with pytest.raises(RuntimeError, match=r"^could not place 1 worker of \{'CPU': 1.0\} within 0.5 s \(strategy "
                                           r"PACK\); the cluster has \{'CPU': 4.0\} in all, \{'CPU': 0\} free$"):
        asyncio.run(pool._wait_placement())
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the placement")]
    assert waits and "1 worker of {'CPU': 1.0} (up to placement_timeout_s=0.5 s)" in waits[0]

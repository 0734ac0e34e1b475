"""A sample call's routing when a worker is lost at awkward moments, over stand-in workers (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pyarrow as pa
import pytest
import ray
from ray.exceptions import RayActorError

from rollout.params import SamplingParams
from rollout.pool import WorkerPool
from rollout.sample_call import SampleCall
from tests.test_worker_pool import pool_of
from workers.messages import PromptGroup


async def _value(value: object) -> object:
    return value


class StandInStream:
    """A worker's `generate` stream: the acknowledgement (None), then one record batch per prompt group;
    every step raises RayActorError once the worker is dead, as a killed actor's stream does (an exception
    among the items is raised in its place: the worker dies there)."""

    def __init__(self, worker: SimpleNamespace, groups: list[PromptGroup]) -> None:
        self.worker = worker
        self.items: list = [None] + [pa.record_batch({"prompt_index": [g.prompt_index] * len(g.sample_indices),
                                                      "sample_index": list(g.sample_indices)}) for g in groups]

    def __aiter__(self) -> StandInStream:
        return self

    async def __anext__(self):
        if self.worker.dead:
            raise RayActorError()
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return _value(item)


def stand_in_worker(served: list[int], worker_id: int) -> SimpleNamespace:
    """A live worker that records its id in `served` for each stream it opens."""
    worker = SimpleNamespace(dead=False)

    def generate(call_id: str, groups: list[PromptGroup], params: SamplingParams) -> StandInStream:
        served.append(worker_id)
        return StandInStream(worker, groups)

    worker.generate = SimpleNamespace(remote=generate)
    return worker


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerPool, list[int]]:
    """Two stand-in workers with equal caches and no load; losing one replaces nothing."""
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: setattr(handle, "dead", True))
    monkeypatch.setattr(ray, "cancel", lambda generator: None)
    served: list[int] = []
    pool = pool_of({0: 64, 1: 64}, {0: 0, 1: 0}, [])
    pool.workers, pool.closed = {w: stand_in_worker(served, w) for w in (0, 1)}, True
    return pool, served


def run_call(pool: WorkerPool, prompts: int, n: int) -> list[tuple[int, int]]:
    """The (prompt, sample) keys of every row a call of `prompts` prompts with `n` samples each yields."""
    async def collect() -> list[tuple[int, int]]:
        call = SampleCall(pool, [[5, 6 + i] for i in range(prompts)], SamplingParams(n=n), num_blocks=64)
        items = [item async for item in call.run()]
        assert items[0] == prompts * n
        return [key for batch in items[1:] for key in zip(batch.column("prompt_index").to_pylist(),
                                                          batch.column("sample_index").to_pylist())]
    return asyncio.run(asyncio.wait_for(collect(), timeout=10))


def test_a_worker_lost_between_routing_and_opening_its_stream_has_its_share_routed_again(pool):
    """The soak test's KeyError: a worker lost after the call's prompts were assigned to it, before its
    stream opened (the pool notices deaths on its own tasks), must not fail the call; its share goes to a
    live worker and every sample arrives once."""
    pool, served = pool
    assign = pool.assign

    def assign_then_lose(demands: dict[int, int], num_blocks: int) -> dict[int, list[int]]:
        plan = assign(demands, num_blocks)
        if 0 in pool.workers:  # the death noticed before the streams open
            asyncio.get_running_loop().call_soon(pool.lose, 0, pool.workers[0], RayActorError())
        return plan

    pool.assign = assign_then_lose
    keys = run_call(pool, prompts=4, n=3)
    assert sorted(keys) == [(p, s) for p in range(4) for s in range(3)]
    assert served[-1] == 1 and list(pool.workers) == [1] and pool.load == {1: 0}


def test_a_worker_lost_part_way_through_a_prompt_has_only_its_missing_samples_resent(pool):
    """A worker lost after some of a prompt's samples arrived: only the ones still missing go to another
    worker, so that every sample arrives exactly once."""
    pool, served = pool
    generate = pool.workers[0].generate.remote

    def dies_part_way(call_id: str, groups: list[PromptGroup], params: SamplingParams) -> StandInStream:
        stream = generate(call_id, groups, params)
        stream.items[1:] = [stream.items[1].slice(0, 1), RayActorError()]  # one sample of its first prompt
        return stream

    pool.workers[0].generate = SimpleNamespace(remote=dies_part_way)
    keys = run_call(pool, prompts=4, n=3)
    assert sorted(keys) == [(p, s) for p in range(4) for s in range(3)]
    assert served == [0, 1, 1] and list(pool.workers) == [1]


def test_a_worker_stream_that_ends_with_samples_missing_fails_the_call(pool):
    """A worker's stream that ends normally while it still owes samples fails the call naming the worker,
    rather than leave the call waiting for ever for samples nobody will send."""
    pool, served = pool
    generate = pool.workers[0].generate.remote

    def short(call_id: str, groups: list[PromptGroup], params: SamplingParams) -> StandInStream:
        stream = generate(call_id, groups, params)
        stream.items[-1] = stream.items[-1].slice(0, 1)  # its last group's batch lacks all but one sample
        return stream

    pool.workers[0].generate = SimpleNamespace(remote=short)
    with pytest.raises(RuntimeError, match="worker 0 ended a stream with samples missing"):
        run_call(pool, prompts=4, n=3)


def test_a_lost_workers_replacement_keeps_its_load_when_the_old_streams_end(pool):
    """Samples owed by a lost worker's stream are not taken off the load of the replacement that took its
    id: routing would favour the replacement for good."""
    pool, served = pool
    old = pool.workers[0]
    pool.lose(0, old, RayActorError())
    pool.workers[0], pool.load[0] = stand_in_worker(served, 0), 0  # admitted under the same id
    pool.release(0, old, 5)
    assert pool.load == {0: 0, 1: 0}


def test_an_aborted_call_ends_while_it_waits_for_a_worker(pool):
    """Every worker down and a replacement starting: a call aborted meanwhile (its caller died) ends at once
    with the abort's reason, instead of waiting for the replacement and handing it the dead caller's work."""
    pool, served = pool

    async def aborted_while_waiting() -> None:
        for worker, handle in list(pool.workers.items()):
            pool.lose(worker, handle, RayActorError())
        pool.replacing = {0: asyncio.get_running_loop().create_future()}  # never admitted
        call = SampleCall(pool, [[5, 6]], SamplingParams(n=2), num_blocks=64)
        asyncio.get_running_loop().call_later(0.05, call.abort, RuntimeError("the caller died"))
        with pytest.raises(RuntimeError, match="the caller died"):
            await asyncio.wait_for(anext(call.run()), timeout=2)

    asyncio.run(aborted_while_waiting())
    assert served == []


def test_a_call_cancelled_while_it_waits_for_a_worker_opens_no_stream_later(pool):
    """A call whose consumer went away (Ray cancels the service's generator) while every worker is down stops
    routing: the replacement, once admitted, gets no stream that nobody would read or close (its samples
    generated for nobody, its load counted for good), and no task of the call is left waiting."""
    pool, served = pool

    async def cancelled_while_waiting() -> None:
        for worker, handle in list(pool.workers.items()):
            pool.lose(worker, handle, RayActorError())
        replacement = asyncio.get_running_loop().create_future()
        pool.replacing = {0: replacement}
        run = SampleCall(pool, [[5, 6]], SamplingParams(n=2), num_blocks=64).run()
        first = asyncio.ensure_future(anext(run))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await run.aclose()
        pool.workers[0], pool.load[0], pool.replacing = stand_in_worker(served, 0), 0, {}  # admitted
        replacement.set_result(None)
        await asyncio.sleep(0.05)
        assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []

    asyncio.run(cancelled_while_waiting())
    assert served == [] and pool.load == {0: 0}

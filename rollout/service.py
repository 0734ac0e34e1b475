"""The service actor behind `rollout.sample` and `RolloutClient`: one named actor that owns the worker pool
and serves `sample` calls from any driver; `launch` starts it and waits until every engine is loaded."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Iterator

import pyarrow as pa
import ray
from ray.actor import ActorHandle

from rollout.callers import CallerWatch
from rollout.config import ServiceConfig
from rollout.local_ray import get_result, named_actor
from rollout.params import SamplingParams
from rollout.pool import WorkerPool, worker_count
from rollout.sample_call import SampleCall
from rollout.service_lost import ServiceUnavailable, reachable
from rollout.weight_keeper import start_keeper, stop_keeper
from rollout.weight_updates import WeightUpdates
from workers.messages import Caller, WeightGroup, WeightUpdate


class RolloutService:
    """A Ray actor (async: calls from many drivers stream at once) that routes prompts to its workers and
    applies weight updates to all of them. It starts its workers at once; every call waits for `ready`.

    A detached service has a `WeightKeeper` and is restarted by Ray after a crash: its workers died with
    it (they are its children), so it starts new ones and replays the keeper's latest update into them."""

    def __init__(self, config: ServiceConfig, keeper: ActorHandle | None = None) -> None:
        self.keeper = keeper
        self.weights = WeightUpdates(config, keeper)
        self.pool = WorkerPool(config, prepare=self.weights.replay)
        self.callers = CallerWatch()
        self.stopping = False
        self.running_calls = asyncio.Semaphore(MAX_CALLS)
        self.started = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> int:
        await self.weights.recall()
        workers = await self.pool.ready()
        await self.weights.restore(self.pool)
        return workers

    async def ready(self) -> int:
        """Wait until every worker's engine has loaded (and, after a restart, holds the latest weights);
        returns the number of workers."""
        return await asyncio.shield(self.started)

    async def sample(self, prompts: list[str] | list[list[int]], params: SamplingParams,
                     caller: Caller) -> AsyncIterator[pa.RecordBatch | int]:
        """Yield the number of samples once every prompt is validated and queued, then record batches as
        samples finish. The call is aborted if `caller`'s process dies."""
        async with self.running_calls:  # a call beyond MAX_CALLS waits here, not in Ray's queue before `stats`
            with self._serving(finished=False):  # once it has run, its samples are all out: none is refused
                await self.ready()
                token_ids, num_blocks = await self.pool.tokenize(prompts, params)
                call = SampleCall(self.pool, token_ids, params, num_blocks)
                with self.callers.watching(caller, call):
                    async for item in call.run():
                        yield item

    async def stats(self) -> dict[int, dict]:
        """Engine counters, weights version and outstanding load of every live worker, by worker id."""
        with self._serving():
            await self.ready()
            return await self.pool.stats()

    async def check_weights(self, update: WeightUpdate) -> list[list[str]]:
        """Raise ValueError if the engines would refuse the update's tensors; changes nothing. Returns the
        groups of the update's names that the model ties into one tensor."""
        with self._serving():
            await self.ready()
            return await self.weights.check(self.pool, update)

    async def update_weights(self, update: WeightUpdate) -> None:
        """Check the update, apply it on every worker; returns once every live worker has its version. Slots
        left empty because their replacement could not take the previous weights are filled again."""
        with self._serving():
            await self.ready()
            await self.weights.apply(self.pool, update)
            self.pool.refill()

    async def weight_group_spec(self, backend: str | None) -> tuple[int, str]:
        """World size and backend of a new broadcast group (see `init_weight_sync`)."""
        with self._serving():
            await self.ready()
            return await self.weights.group_spec(self.pool, backend)

    async def join_weight_group(self, group: WeightGroup) -> None:
        """Have every worker join the trainer's broadcast group; returns once all have."""
        with self._serving():
            await self.ready()
            await self.weights.join_group(self.pool, group)

    @contextlib.contextmanager
    def _serving(self, finished: bool = True) -> Iterator[None]:
        """Refuse a call with `ServiceUnavailable` once `shutdown` has begun: at its start, when it fails, and (with
        `finished`) when it returns; what it would otherwise give comes from a pool being emptied (no stats, "every
        worker has died", an update that reached no worker or a weight keeper just killed)."""
        self._refuse_once_stopping()
        try:
            yield
        except Exception as err:
            self._refuse_once_stopping(err)
            raise
        if finished:
            self._refuse_once_stopping()

    def _refuse_once_stopping(self, err: Exception | None = None) -> None:
        if self.stopping:
            raise ServiceUnavailable(_STOPPED) from err

    async def shutdown(self) -> None:
        """Abort the running calls, stop replacing workers, kill them and free their placement; the actor itself
        is killed by the caller. (Async, so that it runs on the event loop that owns the replacement tasks it
        cancels.)"""
        self.stopping = True
        self.started.cancel()
        await self.callers.abort_all(ServiceUnavailable(_STOPPED))
        self.pool.shutdown()
        if self.keeper is not None:
            ray.kill(self.keeper, no_restart=True)


MAX_CALLS = 1000  # sample calls run at once (each holds a slot of each worker it uses: 1,000, Ray's default)
# Slots of the service actor: every sample call may wait in one, so that `stats`, weight updates and `shutdown`
# always find one free.
_ACTOR_SLOTS = 100_000
_STOPPED = "the rollout service was stopped (rollout.shutdown() or `rollout stop`)"
_RemoteService = ray.remote(RolloutService)


def launch(config: ServiceConfig, *, detached: bool = False) -> ActorHandle:
    """Start the service actor named `config.name` in `config.namespace` and wait until it is ready.
    A detached service outlives the driver that started it (`rollout serve --detach`), and Ray restarts it
    whenever it dies other than by `stop` (its calls in flight fail; see `RolloutService`)."""
    worker_count(config)  # refused here, not as the death of the service actor with its traceback
    if actor_exists(config.name, config.namespace):  # before start_keeper replaces a running service's keeper
        raise ValueError(f"a rollout service named {config.name!r} already runs in namespace "
                         f"{config.namespace!r}; stop it first (`rollout stop`)")
    keeper = start_keeper(config) if detached else None
    service = _RemoteService.options(
        name=config.name, namespace=config.namespace, num_cpus=0, max_concurrency=_ACTOR_SLOTS,
        max_restarts=-1 if detached else 0,
        max_task_retries=0, lifetime="detached" if detached else None).remote(config, keeper)
    try:
        get_result(service.ready.remote())  # raised in the service, or in a worker under it: the cause says why
    except BaseException:
        stop(service)
        stop_keeper(config)
        raise
    return service


def actor_exists(name: str, namespace: str) -> bool:
    """True while an actor of this name lives in `namespace` (Ray frees a name some time after a kill)."""
    return named_actor(name, namespace) is not None


def stop(service: ActorHandle) -> None:
    """Stop a service: its workers and weight keeper, then the service actor itself (for good: no restart).
    Nothing once this process has left the Ray `service` was reached through: Ray would start a new cluster."""
    if not reachable(service):
        return
    try:
        ray.get(service.shutdown.remote(), timeout=30)
    except ray.exceptions.RayError:
        pass  # already dead or stuck: killing it below also ends the workers it owns
    ray.kill(service, no_restart=True)

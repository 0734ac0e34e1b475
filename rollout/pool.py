"""The worker pool of a service: placement (one GPU per worker, or CPUs), start-up, routing by load, losses
and their replacement."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorAlreadyExistsError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.config import ServiceConfig
from rollout.local_ray import NAME_RELEASE_S
from rollout.params import SamplingParams
from rollout.stall_watch import StallWatch
from workers.actor import RemoteWorker

log = logging.getLogger(__name__)
PLACEMENT_LOG_S = 30.0  # how often a placement still pending is logged
_REPLACE_TRIES = 3  # fresh workers started for one lost worker while each dies before it takes work

# Readies a fresh worker (hands it the latest weights), then calls the second argument to admit it to routing.
Prepare = Callable[[ActorHandle, Callable[[], None]], Awaitable[None]]


class WorkerPool:
    """The live worker actors of one service and the samples each still owes (its outstanding load). A lost
    worker (dead, or stalled: see `StallWatch`) is replaced by a fresh one under the same id, which takes work
    once `prepare` has readied it."""

    def __init__(self, config: ServiceConfig, prepare: Prepare) -> None:
        self.config = config
        self.prepare = prepare
        self.placement = _placement_group(config)
        self.size = len(self.placement.bundle_specs)
        self.workers: dict[int, ActorHandle] = {}  # started by `ready`
        self.load: dict[int, int] = {}
        self.num_blocks: dict[int, int] = {}  # each worker's KV cache, reported by `ready`
        self.starting: dict[int, ActorHandle] = {}  # replacements not yet admitted to routing
        self.replacing: dict[int, asyncio.Task] = {}
        self.vacant: set[int] = set()  # slots whose replacement could not take the latest weights
        self.watches: dict[int, asyncio.Task] = {}
        self.stall_watch: asyncio.Task | None = None
        self.closed = False

    def _spawn(self, worker_id: int) -> ActorHandle:
        resources: dict = {"num_cpus": self.config.cpus_per_worker, "scheduling_strategy":
                           PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=worker_id)}
        if "GPU" in self.placement.bundle_specs[0]:
            resources["num_gpus"] = 1
        # No retries: Ray would re-run a streaming call and skip items by index, duplicating and losing
        # samples. A lost worker's samples are resent by the service instead.
        return RemoteWorker.options(
            name=f"{self.config.name}-worker-{worker_id}", namespace=self.config.namespace,
            max_restarts=0, max_task_retries=0, **resources).remote(self.config, worker_id)

    async def ready(self) -> int:
        """Start the workers, wait for the placement and for every engine to load; returns the number of
        workers. Called once, before any other method."""
        for worker in range(self.size):  # a restarted service waits for its predecessor's names to be released
            self.workers[worker] = await self._respawn(worker)
            self.load[worker] = 0
        await self._wait_placement()
        try:
            sizes = await asyncio.gather(*(w.ready.remote() for w in self.workers.values()))
        except BaseException:  # a worker whose engine failed lives on to report it: end them all now
            self.shutdown()
            raise
        self.num_blocks.update(zip(self.workers, sizes))
        for worker, handle in self.workers.items():
            self._watch(worker, handle)
        self.stall_watch = asyncio.get_running_loop().create_task(StallWatch(self).run())
        return len(self.workers)

    async def _wait_placement(self) -> None:
        """Wait up to `placement_timeout_s` for the workers' placement, saying every PLACEMENT_LOG_S what it
        waits for (a request the cluster cannot hold would otherwise wait in silence); RuntimeError after."""
        ready = asyncio.ensure_future(self.placement.ready())
        deadline = time.monotonic() + self.config.placement_timeout_s
        while True:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait([ready], timeout=min(PLACEMENT_LOG_S, max(left, 0)))
            if done:
                return await ready
            if left <= PLACEMENT_LOG_S:
                ready.cancel()
                raise RuntimeError(f"could not place {self._placement_need()} within "
                                   f"{self.config.placement_timeout_s} s (strategy "
                                   f"{self.config.placement_strategy}); {self._placement_have()}")
            log.warning("waiting for the placement of %s (up to placement_timeout_s=%s s); %s",
                        self._placement_need(), self.config.placement_timeout_s, self._placement_have())

    def _placement_need(self) -> str:
        return f"{self.size} worker{'s' * (self.size != 1)} of {self.placement.bundle_specs[0]}"

    def _placement_have(self) -> str:
        bundle, total, free = self.placement.bundle_specs[0], ray.cluster_resources(), ray.available_resources()
        return (f"the cluster has {({k: total.get(k, 0) for k in bundle})} in all, "
                f"{({k: free.get(k, 0) for k in bundle})} free")

    def _watch(self, worker: int, handle: ActorHandle) -> None:
        """Notice the worker's death even while no call of it runs, so that it is replaced at once."""
        self.watches[worker] = asyncio.get_running_loop().create_task(self._await_death(worker, handle))

    async def _await_death(self, worker: int, handle: ActorHandle) -> None:
        try:
            await handle.alive.remote()
        except RayActorError as err:
            self.lose(worker, handle, err)

    async def wait_live(self) -> None:
        """Return once some worker takes work, waiting for replacements while every worker is down."""
        while not self.workers and self.replacing:
            await asyncio.wait(list(self.replacing.values()), return_when=asyncio.FIRST_COMPLETED)
        if not self.workers:
            raise RuntimeError("every worker of the service has died")

    async def wait_replacements(self) -> None:
        """Return once no replacement is under way."""
        while self.replacing:
            await asyncio.wait(list(self.replacing.values()))

    def assign(self, demands: dict[int, int], num_blocks: int) -> dict[int, list[int]]:
        """Give each prompt (prompt index -> samples wanted) to the live worker with the least outstanding
        load, largest demands first, among those whose KV cache has at least `num_blocks` blocks (the cache
        the prompts were validated against), or among all when none has (their engines judge then). The
        load counts the samples until `release`d. Call `wait_live` first."""
        plan: dict[int, list[int]] = {}
        holding = [worker for worker in self.load if self.num_blocks[worker] >= num_blocks] or list(self.load)
        for prompt, samples in sorted(demands.items(), key=lambda item: -item[1]):
            worker = min(holding, key=self.load.__getitem__)
            self.load[worker] += samples
            plan.setdefault(worker, []).append(prompt)
        return plan

    def release(self, worker: int, handle: ActorHandle, samples: int) -> None:
        """`samples` of the worker's outstanding load arrived or were given up; a no-op when `handle` is no
        longer that worker (its replacement under the same id owes none of them)."""
        if self.workers.get(worker) is handle:
            self.load[worker] -= samples

    def lose(self, worker: int, handle: ActorHandle, reason: BaseException) -> None:
        """Take a failed worker out of routing, killed so that it can send nothing more, and start its
        replacement; a no-op when `handle` is no longer that worker (lost before, or replaced)."""
        if self.workers.get(worker) is not handle:
            return
        del self.workers[worker], self.load[worker]
        log.warning("worker %d lost (%s); %d workers left, replacing it", worker, type(reason).__name__,
                    len(self.workers))
        ray.kill(handle, no_restart=True)
        if not self.closed:
            self.replacing[worker] = asyncio.get_running_loop().create_task(self._replace(worker))

    async def _replace(self, worker: int) -> None:
        """Start a fresh worker under a lost one's id; it takes work once its engine has loaded and `prepare`
        has handed it the latest weights. A replacement that dies before that is lost like any worker and
        started again, `_REPLACE_TRIES` times in all; one that fails otherwise is given up: for good if its
        engine refused the model, until the next update (`refill`) if it could not take the latest weights
        (their source gone, a checkpoint rewritten)."""
        try:
            for attempt in range(1, _REPLACE_TRIES + 1):
                try:
                    handle = self.starting[worker] = await self._respawn(worker)
                    self.num_blocks[worker] = await handle.ready.remote()  # its engine has loaded
                    self.vacant.add(worker)
                    await self.prepare(handle, lambda: self._admit(worker))
                    self.vacant.discard(worker)
                    log.warning("worker %d replaced", worker)
                    return
                except RayActorError as err:
                    if attempt == _REPLACE_TRIES:
                        raise
                    log.warning("the replacement of worker %d died (%r); starting another", worker, err)
                    ray.kill(self.starting.pop(worker), no_restart=True)
        except Exception as err:
            log.error("could not replace worker %d: %r", worker, err)
            if worker in self.starting:
                ray.kill(self.starting.pop(worker), no_restart=True)
        finally:
            self.replacing.pop(worker, None)

    async def _respawn(self, worker: int) -> ActorHandle:
        """`_spawn` as soon as Ray has released the actor name of a lost worker (or of a crashed service's)."""
        deadline = time.monotonic() + NAME_RELEASE_S
        while True:
            try:
                return self._spawn(worker)
            except ActorAlreadyExistsError:  # the kill has not completed yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def refill(self) -> None:
        """Start replacements again for the slots whose last one could not take the weights then latest: a
        new update has replaced them."""
        for worker in sorted(self.vacant - set(self.replacing) if not self.closed else ()):
            log.warning("replacing worker %d again with the new weights", worker)
            self.replacing[worker] = asyncio.get_running_loop().create_task(self._replace(worker))

    def _admit(self, worker: int) -> None:
        self.workers[worker] = self.starting.pop(worker)
        self.load[worker] = 0
        self._watch(worker, self.workers[worker])

    async def call_any(self, method: str, *args: Any) -> Any:
        """`method(*args)` on the least-loaded live worker; if that worker is lost meanwhile, on another."""
        return (await self._call_first(self.load.__getitem__, method, *args))[1]

    async def _call_first(self, rank: Callable[[int], Any], method: str, *args: Any) -> tuple[int, Any]:
        """(worker id, `method(*args)`) on the live worker ranked first by `rank(worker id)`; if that worker is
        lost meanwhile, on the next one ranked first."""
        while True:
            await self.wait_live()
            worker = min(self.load, key=rank)
            handle = self.workers[worker]
            try:
                return worker, await getattr(handle, method).remote(*args)
            except RayActorError as err:
                self.lose(worker, handle, err)

    async def tokenize(self, prompts: list, params: SamplingParams) -> tuple[list[list[int]], int]:
        """Token ids of `prompts`, validated by the engine of the live worker with the smallest KV cache (the
        least loaded of those), so that a bad prompt, or one whose samples some worker's cache could not
        hold, is refused before any worker has work; and that cache's size in blocks, for `assign`. Caches
        sized automatically differ between GPUs."""
        worker, ids = await self._call_first(lambda w: (self.num_blocks[w], self.load[w]), "tokenize", prompts, params)
        return ids, self.num_blocks[worker]

    async def call_all(self, method: str, *args: Any) -> dict[int, Any]:
        """`method(*args)` on every live worker at once; results by worker id. Workers lost meanwhile are
        left out (and replaced); any other error is raised once every call has ended."""
        workers = dict(self.workers)
        results = await asyncio.gather(*(getattr(h, method).remote(*args) for h in workers.values()),
                                       return_exceptions=True)
        for (worker, handle), result in zip(workers.items(), results):
            if isinstance(result, RayActorError):
                self.lose(worker, handle, result)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RayActorError)]
        if errors:
            raise errors[0]
        return {worker: result for worker, result in zip(workers, results) if worker in self.workers}

    async def stats(self) -> dict[int, dict]:
        """Engine counters of every live worker, with its outstanding load."""
        stats = await self.call_all("stats")
        return {i: {**s, "outstanding": self.load[i]} for i, s in stats.items()}

    def shutdown(self) -> None:
        """Stop replacing, kill every worker (replacements under way included) and free the placement group;
        a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        for task in [*self.replacing.values(), *self.watches.values(), self.stall_watch]:
            if task is not None:
                task.cancel()
        for workers in (self.workers, self.starting):
            for worker in list(workers):
                ray.kill(workers.pop(worker), no_restart=True)
        self.load.clear()
        remove_placement_group(self.placement)


def _placement_group(config: ServiceConfig) -> PlacementGroup:
    """One bundle per worker, reserved all at once with `config.placement_strategy`: one GPU and
    `cpus_per_worker` CPUs for CUDA engines (one worker per GPU of the cluster by default),
    `cpus_per_worker` CPUs for CPU engines (one worker)."""
    cuda = config.engine.device.startswith("cuda")
    bundle = {"GPU": 1, "CPU": config.cpus_per_worker} if cuda else {"CPU": config.cpus_per_worker}
    return placement_group([bundle] * worker_count(config), strategy=config.placement_strategy,
                           name=f"{config.name}-workers")


def worker_count(config: ServiceConfig) -> int:
    """`num_workers`, else one per GPU of the cluster for CUDA engines (ValueError when it has none), one for
    CPU engines."""
    cuda = config.engine.device.startswith("cuda")
    count = config.num_workers or (int(ray.cluster_resources().get("GPU", 0)) if cuda else 1)
    if count < 1:
        raise ValueError("engine.device is 'cuda' but the Ray cluster has no GPUs")
    return count

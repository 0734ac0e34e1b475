"""The worker pool of a service: placement (one GPU per worker, or CPUs), start-up, routing by load, losses."""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.config import ServiceConfig
from workers.actor import RolloutWorker

log = logging.getLogger(__name__)
_RemoteWorker = ray.remote(RolloutWorker)


class WorkerPool:
    """The live worker actors of one service and the samples each still owes (its outstanding load)."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.placement = _placement_group(config)
        count = len(self.placement.bundle_specs) if self.placement else config.num_workers or 1
        self.workers: dict[int, ActorHandle] = {i: self._spawn(i) for i in range(count)}
        self.load = dict.fromkeys(self.workers, 0)

    def _spawn(self, worker_id: int) -> ActorHandle:
        resources: dict = {"num_cpus": self.config.cpus_per_worker}
        if self.placement:
            resources["num_gpus"] = 1
            resources["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=worker_id)
        # No retries: Ray would re-run a streaming call and skip items by index, duplicating and losing
        # samples. A lost worker's samples are resent by the service instead.
        return _RemoteWorker.options(
            name=f"{self.config.name}-worker-{worker_id}", namespace=self.config.namespace,
            max_restarts=0, max_task_retries=0, **resources).remote(self.config, worker_id)

    async def ready(self) -> int:
        """Wait for the placement and for every engine to load; returns the number of workers."""
        if self.placement:
            try:
                await asyncio.wait_for(self.placement.ready(), self.config.placement_timeout_s)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"could not place {len(self.workers)} one-GPU workers within "
                    f"{self.config.placement_timeout_s} s; the cluster has "
                    f"{ray.cluster_resources().get('GPU', 0)} GPUs") from None
        await asyncio.gather(*(w.stats.remote() for w in self.workers.values()))
        return len(self.workers)

    def assign(self, demands: dict[int, int]) -> dict[int, list[int]]:
        """Give each prompt (prompt index -> samples wanted) to the live worker with the least outstanding
        load, largest demands first; the load counts the samples until `release`d."""
        if not self.workers:
            raise RuntimeError("every worker of the service has died")
        plan: dict[int, list[int]] = {}
        for prompt, samples in sorted(demands.items(), key=lambda item: -item[1]):
            worker = min(self.load, key=self.load.__getitem__)
            self.load[worker] += samples
            plan.setdefault(worker, []).append(prompt)
        return plan

    def release(self, worker: int, samples: int) -> None:
        """`samples` of the worker's outstanding load arrived or were given up."""
        if worker in self.load:
            self.load[worker] -= samples

    def lose(self, worker: int, reason: BaseException) -> None:
        """Take a failed worker out of routing for good; killed, so that it can send nothing more."""
        handle = self.workers.pop(worker, None)
        if handle is None:
            return
        del self.load[worker]
        log.warning("worker %d lost (%s); %d workers left", worker, type(reason).__name__, len(self.workers))
        ray.kill(handle, no_restart=True)

    async def tokenize(self, prompts: list) -> list[list[int]]:
        """Token ids of `prompts`, validated by the least-loaded live worker's engine."""
        while True:
            worker = min(self.load, key=self.load.__getitem__, default=None)
            if worker is None:
                raise RuntimeError("every worker of the service has died")
            try:
                return await self.workers[worker].tokenize.remote(prompts)
            except RayActorError as err:
                self.lose(worker, err)

    async def stats(self) -> dict[int, dict]:
        """Engine counters of every live worker, with its outstanding load."""
        stats = await asyncio.gather(*(w.stats.remote() for w in self.workers.values()))
        return {i: {**s, "outstanding": self.load[i]} for i, s in zip(self.workers, stats)}

    def shutdown(self) -> None:
        """Kill every worker and free the placement group."""
        for worker in list(self.workers):
            ray.kill(self.workers.pop(worker), no_restart=True)
        self.load.clear()
        if self.placement:
            remove_placement_group(self.placement)


def _placement_group(config: ServiceConfig) -> PlacementGroup | None:
    """One bundle of one GPU per worker for CUDA engines (one per GPU of the cluster by default)."""
    if not config.engine.device.startswith("cuda"):
        return None
    count = config.num_workers or int(ray.cluster_resources().get("GPU", 0))
    if count < 1:
        raise ValueError("engine.device is 'cuda' but the Ray cluster has no GPUs")
    bundles = [{"GPU": 1, "CPU": config.cpus_per_worker}] * count
    return placement_group(bundles, strategy="PACK", name=f"{config.name}-workers")

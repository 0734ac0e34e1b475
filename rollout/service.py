"""The service actor behind `rollout.sample` and `RolloutClient`: one named actor that owns the worker pool
and serves `sample` calls from any driver; `launch` starts it and waits until every engine is loaded."""

from __future__ import annotations

from typing import AsyncIterator

import pyarrow as pa
import ray
from ray.actor import ActorHandle

from rollout.config import ServiceConfig
from rollout.params import SamplingParams
from rollout.pool import WorkerPool
from rollout.sample_call import SampleCall


class RolloutService:
    """A Ray actor (async: calls from many drivers stream at once) that routes prompts to its workers."""

    def __init__(self, config: ServiceConfig) -> None:
        self.pool = WorkerPool(config)

    async def ready(self) -> int:
        """Wait until every worker's engine has loaded; returns the number of workers."""
        return await self.pool.ready()

    async def sample(self, prompts: list[str] | list[list[int]],
                     params: SamplingParams) -> AsyncIterator[pa.RecordBatch | int]:
        """Yield the number of samples once every prompt is validated and queued, then record batches as
        samples finish."""
        call = SampleCall(self.pool, await self.pool.tokenize(prompts), params)
        async for item in call.run():
            yield item

    async def stats(self) -> dict[int, dict]:
        """Engine counters and outstanding load of every live worker, by worker id."""
        return await self.pool.stats()

    def shutdown(self) -> None:
        """Kill the workers and free their placement; the actor itself is killed by the caller."""
        self.pool.shutdown()


_RemoteService = ray.remote(RolloutService)


def launch(config: ServiceConfig, *, detached: bool = False) -> ActorHandle:
    """Start the service actor named `config.name` in `config.namespace` and wait until it is ready.
    A detached service outlives the driver that started it (`rollout serve --detach`)."""
    service = _RemoteService.options(
        name=config.name, namespace=config.namespace, num_cpus=0, max_restarts=0, max_task_retries=0,
        lifetime="detached" if detached else None).remote(config)
    try:
        ray.get(service.ready.remote())
    except BaseException:
        stop(service)
        raise
    return service


def stop(service: ActorHandle) -> None:
    """Stop a service: its workers, then the service actor itself."""
    try:
        ray.get(service.shutdown.remote(), timeout=30)
    except ray.exceptions.RayError:
        pass  # already dead or stuck: killing it below also ends the workers it owns
    ray.kill(service, no_restart=True)

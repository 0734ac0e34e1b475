"""The weight keeper of a detached service: a detached actor that holds the replay source of the latest weight
update, so that the service, restarted by Ray after a crash, can replay it into the workers it starts anew."""

from __future__ import annotations

import time

import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorAlreadyExistsError

from rollout.config import ServiceConfig
from rollout.local_ray import NAME_RELEASE_S, named_actor
from workers.messages import WeightUpdate


class WeightKeeper:
    """The latest update's replay source. An object-store update's arrays stay owned by the process that put
    them (the trainer): the keeper only borrows them, so they outlive the service while their owner lives. A
    broadcast's weights are exported from a worker by the keeper itself, which then owns that copy."""

    def __init__(self) -> None:
        self.latest: WeightUpdate | None = None

    def keep(self, update: WeightUpdate) -> None:
        """Keep `update` (an object-store or checkpoint update) as the replay source."""
        self.latest = update

    async def keep_export(self, worker: ActorHandle, update: WeightUpdate) -> WeightUpdate:
        """Keep a copy of `worker`'s weights, owned by this keeper, as the replay source of broadcast `update`;
        returns that source."""
        self.latest = await exported(worker, update)
        return self.latest

    def recall(self) -> WeightUpdate | None:
        """The replay source kept last (None before any update)."""
        return self.latest


async def exported(worker: ActorHandle, update: WeightUpdate) -> WeightUpdate:
    """`update` as an object-store update of a copy of `worker`'s weights, in the names and dtypes the worker
    exported them in (a broadcast may have named them as the checkpoint does), owned by the caller."""
    tensors, arrays = worker.export_weights.remote()
    return msgspec.structs.replace(update, transport="object_store", tensors=await tensors, arrays=arrays,
                                   buckets=[])


def start_keeper(config: ServiceConfig) -> ActorHandle:
    """A fresh keeper for the detached service of `config`, named `{name}-weights` (one left by an earlier
    service of that name is replaced, so that a new service never replays stale weights)."""
    stop_keeper(config)
    remote = ray.remote(WeightKeeper).options(name=_keeper_name(config), namespace=config.namespace,
                                              lifetime="detached", num_cpus=0, max_restarts=0)
    deadline = time.monotonic() + NAME_RELEASE_S
    while True:
        try:
            return remote.remote()
        except ActorAlreadyExistsError:  # the killed one's name is released shortly after
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stop_keeper(config: ServiceConfig) -> None:
    """Kill the keeper of the service of `config`, if it has one."""
    keeper = named_actor(_keeper_name(config), config.namespace)
    if keeper is not None:
        ray.kill(keeper, no_restart=True)


def _keeper_name(config: ServiceConfig) -> str:
    return f"{config.name}-weights"

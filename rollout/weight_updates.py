"""The service's side of weight updates: one at a time, checked on one worker before any worker changes (all
workers hold the same model), applied on every worker at once, and kept as the replay source that a
replacement worker receives before it takes work (and, for a detached service, in its `WeightKeeper`, from
which a restarted service replays it). Also gives the workers their ranks in a broadcast group."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from rollout.config import ServiceConfig
from rollout.pool import WorkerPool
from rollout.weight_keeper import exported
from workers.messages import BACKENDS, WeightGroup, WeightUpdate

log = logging.getLogger(__name__)


class WeightUpdates:
    """The weights state of one service: the latest update (its replay source) and the broadcast group."""

    def __init__(self, config: ServiceConfig, keeper: ActorHandle | None = None) -> None:
        self.device = config.engine.device
        self.keeper = keeper  # a detached service's WeightKeeper
        self.lock = asyncio.Lock()  # held while an update applies, a replay runs, or a group forms
        self.latest: WeightUpdate | None = None
        self.group: dict[int, ActorHandle] = {}  # the workers of the current broadcast group
        self.current: WeightGroup | None = None  # where that group met

    async def check(self, pool: WorkerPool, update: WeightUpdate) -> list[list[str]]:
        """Raise before anything changes: ValueError naming the tensors the engines refuse (missing,
        unexpected, wrong shape or dtype), RuntimeError if a broadcast's group is not the workers' (a later one
        replaced it) or no longer matches the workers. Returns the groups of names the model ties into one
        tensor, whose values only the sender can compare."""
        if update.transport == "broadcast" and self.group != pool.workers:
            raise RuntimeError("the workers changed since init_weight_sync() (one was lost or replaced); "
                               "call init_weight_sync() again before a broadcast update")
        if update.transport == "broadcast" and update.group != self.current:
            raise RuntimeError("this broadcast group was replaced by a later init_weight_sync() (of this or another "
                               "process): the workers left it; update through the newest, or call "
                               "init_weight_sync() again")
        return await pool.call_any("check_weights", update.tensors, update.transport == "checkpoint")

    async def apply(self, pool: WorkerPool, update: WeightUpdate) -> None:
        """Check `update`, then apply it on every live worker and keep it for replay. A worker lost meanwhile
        is replaced and its replacement gets this update before it takes work."""
        await self.check(pool, update)
        async with self.lock:
            try:  # the live update is loaded now; only a later replay checks the checkpoint's stamp
                await pool.call_all("update_weights", msgspec.structs.replace(update, stamp=[]))
            except Exception as err:
                err.add_note(await versions_note(pool, update.version))
                raise
            self.latest = await self._replay_source(pool, update)

    async def _replay_source(self, pool: WorkerPool, update: WeightUpdate) -> WeightUpdate:
        """What a replacement receives: the update itself (object-store ref or checkpoint path), or for a
        broadcast a copy of the new weights that one worker returns into the object store (owned by this
        service, so it outlives that worker)."""
        replay = msgspec.structs.replace(update, mode="continue")
        if update.transport != "broadcast":
            if self.keeper is not None:
                await self.keeper.keep.remote(replay)
            return replay
        for worker, handle in sorted(pool.workers.items()):
            try:
                return await self._export(handle, replay)
            except RayActorError as err:
                pool.lose(worker, handle, err)
        raise RuntimeError("every worker was lost before the broadcast weights could be kept for replay")

    async def _export(self, handle: ActorHandle, replay: WeightUpdate) -> WeightUpdate:
        """A copy of the worker's weights as an object-store update, owned by the keeper if there is one."""
        if self.keeper is not None:
            return await self.keeper.keep_export.remote(handle, replay)
        return await exported(handle, replay)

    async def recall(self) -> None:
        """Take the keeper's replay source as the latest update (a service restarted after a crash)."""
        if self.keeper is not None:
            self.latest = await self.keeper.recall.remote()

    async def restore(self, pool: WorkerPool) -> None:
        """Apply the recalled update on every worker of a restarted service. If its source is gone (the
        trainer that owned an object-store update died, a checkpoint was deleted), the workers keep the
        model's own weights and version 0, and an error is logged."""
        if self.latest is None:
            return
        async with self.lock:
            try:
                await pool.call_all("update_weights", self.latest)
            except Exception as err:
                log.error("could not replay weights version %d after a restart: %r", self.latest.version, err)
                self.latest = None

    async def replay(self, handle: ActorHandle, admit: Callable[[], None]) -> None:
        """Give a fresh worker the latest weights and version, then `admit` it to routing, with no update
        in between."""
        async with self.lock:
            if self.latest is not None:
                await handle.update_weights.remote(self.latest)
            admit()

    async def group_spec(self, pool: WorkerPool, backend: str | None) -> tuple[int, str]:
        """The size (trainer + live workers) and backend of a new broadcast group; the backend defaults to
        NCCL for CUDA engines and gloo otherwise."""
        backend = backend or ("nccl" if self.device.startswith("cuda") else "gloo")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        if backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(f"backend 'nccl' needs CUDA engines; engine.device is {self.device!r}")
        await pool.wait_replacements()
        await pool.wait_live()
        return len(pool.workers) + 1, backend

    async def join_group(self, pool: WorkerPool, group: WeightGroup) -> None:
        """Have every live worker join the trainer's broadcast group, ranks 1.. in worker-id order."""
        async with self.lock:
            if group.world_size != len(pool.workers) + 1:
                raise RuntimeError(f"the workers changed while the group formed ({len(pool.workers)} live, "
                                   f"world_size={group.world_size}); call init_weight_sync() again")
            workers = dict(sorted(pool.workers.items()))
            await asyncio.gather(*(h.join_weight_group.remote(group, rank)
                                   for rank, h in enumerate(workers.values(), start=1)))
            self.group, self.current = workers, group


async def versions_note(pool: WorkerPool, version: int) -> str:
    """Which version each worker holds after an update to `version` failed on some of them (each row's
    `policy_version` still tells what made it): the trainer may update again or go on knowingly."""
    try:
        held = {worker: stats["policy_version"] for worker, stats in sorted((await pool.call_all("stats")).items())}
    except Exception as err:  # noqa: BLE001 - the note of another error: say why it is missing
        return f"the workers' versions are unknown ({err!r})"
    on_new = [worker for worker, held_version in held.items() if held_version == version]
    return (f"version {version} reached workers {on_new} of {sorted(held)} (versions held: {held}); "
            "update again to bring every worker to one version")

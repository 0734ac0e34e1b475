"""A worker's side of weight updates: checks an update's tensors against the engine, turns a `WeightUpdate`
into what `Engine.update_weights` takes (a state dict read zero-copy from the object store, a checkpoint
path, or tensors received from the broadcast group) and swaps it in on the engine loop, exports the weights
for replay, and holds the worker's member of the broadcast group. Ray-free: object-store refs are only awaited."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
import torch.distributed as dist

from rollout.params import WeightSource
from workers.loop import EngineLoop
from workers.messages import TensorMeta, WeightGroup, WeightUpdate
from workers.weight_format import check_unchanged, describe, empty_bucket, from_numpy, meta_state, to_numpy, unpack
from workers.weight_group import broadcast, close_group, group_device, join_store, open_group


class WeightReceiver:
    """Weight updates of one worker's engine; every engine call goes through its loop thread."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.store: dist.Store | None = None
        self.group: dist.ProcessGroup | None = None
        self.device = torch.device("cpu")

    async def check(self, tensors: list[TensorMeta], checkpoint: bool) -> list[list[str]]:
        """Raise ValueError unless tensors of these names, shapes and dtypes (a checkpoint directory's, with
        `checkpoint`) would be accepted; the groups of their names the model ties into one tensor."""
        validate = self.loop.engine.validate_weights
        return await asyncio.wrap_future(self.loop.submit(validate, meta_state(tensors), checkpoint))

    async def apply(self, update: WeightUpdate) -> None:
        """Fetch or receive the update's weights, then swap them in between two engine steps."""
        source = await self.source(update)
        await asyncio.wrap_future(self.loop.update(source, update.version, update.mode))

    async def export(self) -> tuple[list[TensorMeta], dict[str, np.ndarray]]:
        """The engine's current weights as numpy arrays (views of CPU parameters; see `to_numpy`), with their
        metadata: the engine's own names, whatever names the update that set them came in."""
        def export() -> tuple[list[TensorMeta], dict[str, np.ndarray]]:
            state = self.loop.engine.state_dict()
            return describe(state), to_numpy(state)
        return await asyncio.wrap_future(self.loop.submit(export))

    def join(self, group: WeightGroup, rank: int, host: str) -> None:
        """Join (or join anew, the old group closed) the broadcast group as `rank`, listening on `host`; blocks
        until every rank has joined, so run it off the event loop."""
        close_group(self.group)
        self.group = self.store = None
        self.store = join_store(group.host, group.port, group.timeout_s)
        self.group = open_group(self.store, rank, group.world_size, group.backend, host, group.timeout_s)
        self.device = group_device(group.backend)

    async def source(self, update: WeightUpdate) -> WeightSource:
        """The update's weights: a checkpoint path (a replay's refused if rewritten since the update was sent),
        tensors over the object-store buffers (no copy), or tensors received from the trainer's broadcast (the
        event loop keeps serving meanwhile)."""
        if update.transport == "checkpoint":
            if update.stamp:  # a replay: a replacement loads the directory again, later
                check_unchanged(update.path, update.stamp, update.version)
            return update.path
        if update.transport == "object_store":
            return from_numpy(await update.arrays, update.tensors)
        return await asyncio.to_thread(self._receive, update)

    def _receive(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Every bucket of a broadcast update, received into fresh flat tensors (one staging copy of the
        weights, because "finish" updates still compute with the old ones until their drain ends)."""
        if self.group is None:
            raise RuntimeError("this worker is not in a broadcast group; call init_weight_sync() first")
        state: dict[str, torch.Tensor] = {}
        for bucket in update.buckets:
            flat = empty_bucket(update.tensors, bucket, self.device)
            broadcast(self.group, flat)
            state.update(unpack(flat, update.tensors, bucket))
        return state

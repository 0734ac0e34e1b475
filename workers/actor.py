"""The worker actor: owns one engine (on its loop thread), streams each call's samples as Arrow batches, and
takes weight updates."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import numpy as np
import pyarrow as pa
import ray

from rollout.config import ServiceConfig
from rollout.params import SamplingParams
from workers.loop import EngineLoop
from workers.messages import PromptGroup, TensorMeta, WeightGroup, WeightUpdate

# The calls that must be answered while `generate` streams fill the actor's default 1,000 slots (its service's
# stall probes, death watch and stats, and weight updates) run in a group of their own, on its own event loop:
# none of them shares an asyncio object with `generate`.
CONTROL = "control"
CONCURRENCY_GROUPS = {CONTROL: 16}


class RolloutWorker:
    """A Ray actor (async, so many calls stream at once) around one `Engine` and its `EngineLoop`."""

    def __init__(self, config: ServiceConfig, worker_id: int) -> None:
        # heavy (torch, transformers): imported only inside the actor process
        from workers.engine import Engine
        from workers.weight_receiver import WeightReceiver

        self.error: Exception | None = None
        try:
            self.loop = EngineLoop(lambda: Engine(config.engine, worker_id=worker_id), config.flush_rows,
                                   config.flush_delay_s)
        except Exception as err:  # kept for `ready`: raised here, it would reach the pool only as Ray's text
            err.__traceback__ = err.__cause__ = err.__context__ = None  # frees the half-built engine
            self.error = err
            return
        self.weights = WeightReceiver(self.loop)

    @ray.method(concurrency_group=CONTROL)
    async def ready(self) -> int:
        """The engine's KV cache size in blocks, once it has loaded; or the error that stopped it (a refused
        model's ValueError, say). The pool calls this before anything else and drops a worker that fails it."""
        if self.error is not None:
            raise self.error
        return self.loop.engine.pool.num_blocks

    async def generate(self, call_id: str, groups: list[PromptGroup],
                       params: SamplingParams) -> AsyncIterator[pa.RecordBatch | None]:
        """Yield None once every group is queued (bad requests fail there), then the call's record batches
        as its samples finish. Cancelling the stream aborts its unfinished samples and frees their blocks."""
        items: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        complete = False
        try:
            await asyncio.wrap_future(self.loop.open(
                call_id, groups, params, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
            yield None
            while (item := await items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
            complete = True
        finally:
            if not complete:
                self.loop.close(call_id)

    async def tokenize(self, prompts: list[str] | list[list[int]],
                       params: SamplingParams | None = None) -> list[list[int]]:
        """Validated token ids of `prompts` (strings go through the model's tokenizer); with `params`, each
        prompt's samples must fit the engine's cache too."""
        return await asyncio.wrap_future(self.loop.submit(self.loop.engine.tokenize, prompts, params))

    @ray.method(concurrency_group=CONTROL)
    async def stats(self) -> dict[str, int]:
        """The engine's counters and weights version."""
        return await asyncio.wrap_future(self.loop.submit(self.loop.engine.stats))

    @ray.method(concurrency_group=CONTROL)
    async def progress(self) -> tuple[int, bool]:
        """The engine loop's finished iterations, and whether it waits idle for work. Answered here on the
        event loop from what the loop thread wrote, so a stuck engine thread shows as no progress."""
        return self.loop.ticks, self.loop.idle

    @ray.method(concurrency_group=CONTROL)
    async def alive(self) -> None:
        """Pending for as long as this worker lives: the service awaits it to notice a death at once."""
        await asyncio.Event().wait()

    @ray.method(concurrency_group=CONTROL)
    async def check_weights(self, tensors: list[TensorMeta], checkpoint: bool = False) -> list[list[str]]:
        """Raise ValueError unless tensors of these names, shapes and dtypes (a checkpoint directory's, with
        `checkpoint`) would be accepted; changes nothing. Returns the groups of names tied into one tensor."""
        return await self.weights.check(tensors, checkpoint)

    @ray.method(concurrency_group=CONTROL)
    async def update_weights(self, update: WeightUpdate) -> int:
        """Fetch or receive the update's weights, then swap them in between two engine steps; returns the
        new version. Rows of samples ending meanwhile stream to their calls as usual."""
        await self.weights.apply(update)
        return update.version

    @ray.method(concurrency_group=CONTROL)
    async def join_weight_group(self, group: WeightGroup, rank: int) -> None:
        """Become `rank` of the trainer's broadcast group (listening on this node's address)."""
        await asyncio.to_thread(self.weights.join, group, rank, ray.util.get_node_ip_address())

    @ray.method(num_returns=2, concurrency_group=CONTROL)
    async def export_weights(self) -> tuple[list[TensorMeta], dict[str, np.ndarray]]:
        """The engine's weights as numpy arrays, and first their names, dtypes and shapes. As return values
        they are owned by the caller, so they outlive this worker: the service keeps them to replay a broadcast
        update into a replacement worker."""
        return await self.weights.export()


RemoteWorker = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RolloutWorker)

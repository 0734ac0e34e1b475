"""The worker actor: owns one engine (on its loop thread) and streams each call's samples as Arrow batches."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pyarrow as pa

from rollout.config import ServiceConfig
from rollout.params import SamplingParams
from workers.loop import EngineLoop
from workers.messages import PromptGroup


class RolloutWorker:
    """A Ray actor (async, so many calls stream at once) around one `Engine` and its `EngineLoop`."""

    def __init__(self, config: ServiceConfig, worker_id: int) -> None:
        from workers.engine import Engine  # heavy (torch, transformers): only inside the actor process

        self.loop = EngineLoop(Engine(config.engine, worker_id=worker_id), config.flush_rows,
                               config.flush_delay_s)

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

    async def tokenize(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Validated token ids of `prompts` (strings go through the model's tokenizer)."""
        return await asyncio.wrap_future(self.loop.submit(self.loop.engine.tokenize, prompts))

    async def stats(self) -> dict[str, int]:
        """The engine's counters; the first call also tells that the engine has loaded."""
        return await asyncio.wrap_future(self.loop.submit(self.loop.engine.stats))

"""One `sample` call inside the service: route prompt groups, merge the workers' streams, resend what a
dead worker still owed, so that every requested sample arrives exactly once."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, AsyncIterator, Coroutine

import pyarrow as pa
import ray
from ray import ObjectRefGenerator
from ray.actor import ActorHandle
from ray.exceptions import ObjectLostError, RayActorError

from rollout.params import SamplingParams, prompt_repeats
from rollout.pool import WorkerPool
from workers.messages import PromptGroup

_END = object()  # a worker's stream ended normally
_LOST = (RayActorError, ObjectLostError)  # the worker (or its node) died: resend what it still owed


class _Stream:
    """One worker's part of a call: the worker, its generator, prompts, and the samples it still owes."""

    def __init__(self, worker: int, handle: ActorHandle, prompts: list[int], owed: int,
                 generator: ObjectRefGenerator) -> None:
        self.worker, self.handle, self.prompts, self.owed, self.generator = worker, handle, prompts, owed, generator
        self.pump_task: asyncio.Task | None = None

    async def pump(self, events: asyncio.Queue) -> None:
        """Forward every batch (then _END, or the error) to `events`."""
        try:
            async for ref in self.generator:
                events.put_nowait((self, await ref))
            events.put_nowait((self, _END))
        except Exception as err:  # judged by the call: a lost worker or a failed request
            events.put_nowait((self, err))

    def close(self) -> None:
        """Stop forwarding and cancel the worker's generator (which aborts its unfinished samples)."""
        if self.pump_task is not None:
            self.pump_task.cancel()
        ray.cancel(self.generator)


class SampleCall:
    """Routes the prompts of one call to workers and yields their batches; see `run`. `num_blocks` is the KV
    cache the prompts were validated against: they go to workers whose cache is at least that large."""

    def __init__(self, pool: WorkerPool, prompts: list[list[int]], params: SamplingParams, num_blocks: int) -> None:
        self.pool, self.prompts, self.params, self.num_blocks = pool, prompts, params, num_blocks
        self.call_id = uuid.uuid4().hex[:16]
        self.missing = {i: set(range(params.n)) for i in range(len(prompts))}
        self.repeats = prompt_repeats(prompts)
        self.streams: list[_Stream] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self.aborted: Exception | None = None
        self._abort_event = asyncio.Event()
        self._serial = itertools.count()

    async def run(self) -> AsyncIterator[pa.RecordBatch | int]:
        """Yield the number of samples once every prompt is queued on a worker, then record batches in
        arrival order until none is missing. Leaving early (cancel, error) cancels the workers' streams."""
        try:
            await self._unless_aborted(self._send(list(self.missing)))
            yield len(self.prompts) * self.params.n
            while any(self.missing.values()):
                stream, item = await self.events.get()
                if isinstance(item, pa.RecordBatch):
                    self._receive(stream, item)
                    yield item
                elif isinstance(item, _LOST):
                    self._drop(stream)
                    self.pool.lose(stream.worker, stream.handle, item)
                    await self._unless_aborted(self._send([i for i in stream.prompts if self.missing[i]]))
                elif item is _END:
                    self._drop(stream)
                    if any(self.missing[i] for i in stream.prompts):
                        raise RuntimeError(f"worker {stream.worker} ended a stream with samples missing")
                else:
                    raise item
        finally:
            for stream in self.streams:
                self.pool.release(stream.worker, stream.handle, stream.owed)
                stream.close()

    async def _send(self, prompts: list[int]) -> None:
        """Route the missing samples of `prompts` and open their streams; a worker lost before it
        acknowledged its share has that share routed again."""
        await self.pool.wait_live()
        plan = self.pool.assign({i: len(self.missing[i]) for i in prompts}, self.num_blocks)
        # The handles now: a worker may be lost before its stream opens (its share is then routed again).
        handles = {worker: self.pool.workers[worker] for worker in plan}
        # Wait for every share before raising, so that each opened stream is known when the call ends.
        results = await asyncio.gather(*(self._open(w, handles[w], share) for w, share in plan.items()),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        again = [i for share in results for i in share]
        if again:
            await self._send(again)

    async def _open(self, worker: int, handle: ActorHandle, prompts: list[int]) -> list[int]:
        """Open one worker's stream for `prompts` and wait for its acknowledgement; returns the prompts
        to route again if the worker is lost (a rejected request raises instead)."""
        groups = [PromptGroup(i, self.prompts[i], sorted(self.missing[i]), self.repeats[i]) for i in prompts]
        generator = handle.generate.remote(f"{self.call_id}.{next(self._serial)}", groups, self.params)
        stream = _Stream(worker, handle, prompts, sum(len(g.sample_indices) for g in groups), generator)
        self.streams.append(stream)
        try:
            await (await generator.__anext__())
        except _LOST as err:
            self._drop(stream)
            self.pool.lose(worker, handle, err)
            return prompts
        stream.pump_task = asyncio.create_task(stream.pump(self.events))
        return []

    def abort(self, reason: Exception) -> None:
        """End the call with `reason` (raised by `run`), cancelling its workers' streams, also while it waits
        for a worker to take its samples (every worker down, say); a second abort changes nothing."""
        if self.aborted is None:
            self.aborted = reason
            self._abort_event.set()
            self.events.put_nowait((None, reason))

    async def _unless_aborted(self, routing: Coroutine[Any, Any, None]) -> None:
        """Await `routing` (a `_send`), or stop it and raise the abort's reason once the call is aborted. A call
        cancelled meanwhile (its consumer went away) stops it too: else it would open streams nobody closes."""
        task = asyncio.ensure_future(routing)
        aborted = asyncio.ensure_future(self._abort_event.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            stopped = not task.done()
            if stopped:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # the streams it opened are in self.streams
        if stopped:
            raise self.aborted
        task.result()

    def _receive(self, stream: _Stream, batch: pa.RecordBatch) -> None:
        prompts = batch.column("prompt_index").to_pylist()
        for prompt, sample in zip(prompts, batch.column("sample_index").to_pylist()):
            self.missing[prompt].discard(sample)
        stream.owed -= batch.num_rows
        self.pool.release(stream.worker, stream.handle, batch.num_rows)

    def _drop(self, stream: _Stream) -> None:
        """Forget a stream that has ended; what it still owed no longer counts as its worker's load."""
        self.streams.remove(stream)
        self.pool.release(stream.worker, stream.handle, stream.owed)

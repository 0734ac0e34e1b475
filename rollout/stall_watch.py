"""The stall watchdog of a worker pool: a worker that has work but whose engine loop makes no progress for
`worker_stall_timeout_s` (a step stuck in a collective, a process stopped by a signal) is lost like a dead
one: killed, its samples resent, a fresh worker started under its id."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

if TYPE_CHECKING:
    from rollout.pool import WorkerPool

log = logging.getLogger(__name__)
_MAX_PERIOD_S = 5.0


class WorkerStalled(RuntimeError):
    """A worker had work and its engine loop made no progress for `worker_stall_timeout_s`."""


@dataclass
class _Seen:
    """What the last probes of one worker showed, and when it last made progress (or had nothing to do)."""

    handle: ActorHandle
    ticks: int
    idle: bool
    since: float


class StallWatch:
    """Probes every live worker's engine-loop progress each `period` (a quarter of the timeout, at most 5 s);
    a probe unanswered within the period counts as no progress (the process may be stopped), and as idle
    only if the worker was idle before and owes no samples."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.timeout = pool.config.worker_stall_timeout_s
        self.period = min(self.timeout / 4, _MAX_PERIOD_S)
        self.seen: dict[int, _Seen] = {}

    async def run(self) -> None:
        """Probe the live workers until cancelled."""
        while True:
            await asyncio.sleep(self.period)
            results = await asyncio.gather(*(self._probe(w, h) for w, h in list(self.pool.workers.items())),
                                           return_exceptions=True)
            for error in [r for r in results if isinstance(r, Exception)]:
                log.error("stall probe failed: %r", error)

    async def _probe(self, worker: int, handle: ActorHandle) -> None:
        seen = self.seen.get(worker)
        if seen is None or seen.handle is not handle:  # a worker new to the watch starts with a clean slate
            seen = self.seen[worker] = _Seen(handle, -1, True, time.monotonic())
        try:
            ticks, idle = await asyncio.wait_for(handle.progress.remote(), self.period)
        except asyncio.TimeoutError:
            ticks, idle = seen.ticks, seen.idle and not self.pool.load.get(worker)
        except RayActorError:
            return  # dead: its death watch replaces it
        now = time.monotonic()
        if idle or ticks != seen.ticks:
            seen.since = now
        seen.ticks, seen.idle = ticks, idle
        if now - seen.since > self.timeout:
            reason = WorkerStalled(f"worker {worker} had work and made no progress for {now - seen.since:.1f} s "
                                   f"(worker_stall_timeout_s={self.timeout})")
            log.warning("%s; killing it", reason)
            self.pool.lose(worker, handle, reason)

"""The callers of a service's running `sample` calls: when a caller's process dies (a killed driver, a failed
trainer actor) Ray does not cancel the call, so the service looks its callers up in Ray's GCS and aborts the
calls of a dead one, which cancels their worker streams and frees their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Iterator

import ray
from ray.core.generated import gcs_pb2

from rollout.sample_call import SampleCall
from workers.messages import Caller

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the callers of running calls are looked up
_LOOKUP_TIMEOUT_S = 10.0


class CallerDied(RuntimeError):
    """The process that made a call died; the call was aborted."""


class CallerWatch:
    """The running calls by caller; while any runs, every `POLL_S` each caller is looked up and the calls of
    one that died are aborted."""

    def __init__(self) -> None:
        self.calls: dict[Caller, set[SampleCall]] = {}
        self.poll: asyncio.Task | None = None

    @contextlib.contextmanager
    def watching(self, caller: Caller, call: SampleCall) -> Iterator[None]:
        """Watch `caller` for as long as `call` runs."""
        self.calls.setdefault(caller, set()).add(call)
        if self.poll is None or self.poll.done():
            self.poll = asyncio.get_running_loop().create_task(self._poll())
        try:
            yield
        finally:
            calls = self.calls[caller]
            calls.discard(call)
            if not calls:
                del self.calls[caller]

    async def abort_all(self, reason: Exception, timeout_s: float = 2.0) -> None:
        """Abort every running call with `reason`, and wait at most `timeout_s` for them to end (so that their
        callers get `reason`, not the death of the workers that follows)."""
        for calls in list(self.calls.values()):
            for call in calls:
                call.abort(reason)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def _poll(self) -> None:
        while self.calls:
            await asyncio.sleep(POLL_S)
            for caller in list(self.calls):
                if not await caller_alive(caller):
                    log.warning("the caller of %d running calls died (job %s, worker %s); aborting them",
                                len(self.calls.get(caller, ())), caller.job_id, caller.worker_id)
                    for call in self.calls.get(caller, ()):
                        call.abort(CallerDied(f"the caller (job {caller.job_id}, worker {caller.worker_id}) died"))


async def caller_alive(caller: Caller) -> bool:
    """False once Ray's GCS has the caller's job finished or its worker dead (a killed process at once, a
    lost node once Ray declares it dead). True when the GCS cannot say: a call is never aborted on doubt."""
    try:
        jobs = await ray._private.worker.global_worker.gcs_client.async_get_all_job_info(
            job_or_submission_id=caller.job_id, skip_submission_job_info_field=True,
            skip_is_running_tasks_field=True, timeout=_LOOKUP_TIMEOUT_S)
        worker = await asyncio.wait_for(asyncio.to_thread(_worker_info, caller.worker_id), _LOOKUP_TIMEOUT_S)
    except Exception as err:
        log.warning("could not look up the caller %s: %r", caller, err)
        return True
    job_dead = any(info.is_dead for info in jobs.values())
    return not job_dead and (worker is None or worker.is_alive)


def _worker_info(worker_id: str) -> gcs_pb2.WorkerTableData | None:
    """The GCS's record of a worker or driver (None if it has none)."""
    accessor = ray._private.state.state._connect_and_get_accessor()
    data = accessor.get_worker_info(ray.WorkerID.from_hex(worker_id))
    return None if data is None else gcs_pb2.WorkerTableData.FromString(data)

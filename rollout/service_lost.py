"""The callers' view of a dead service actor: Ray's error for it becomes `ServiceUnavailable`, raised at once
by the call that was waiting on the service."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError


class ServiceUnavailable(RuntimeError):
    """The rollout service actor died, or is restarting, while a call waited on it; or this process has
    left Ray since it reached the service."""


class _Calls:
    """The threads of this process inside a call to a service, so that `rollout.shutdown` can refuse new calls
    and wait for those inside to return before Ray stops: a thread inside a Ray call when Ray shuts down can
    end the whole process."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inside = 0
        self.closing = False


_CALLS = _Calls()
_SHUT_DOWN = "rollout.shutdown() stopped the rollout service while this call waited on it"
_LEFT_RAY = ("this process is no longer connected to the Ray it reached the rollout service through "
             "(rollout.shutdown() or ray.shutdown() ran), so the service is out of reach: start or join it "
             "again with rollout.init() or RolloutClient.connect()")
_REACHED: dict[int, tuple[str, str]] = {}  # id of a service handle -> the Ray connection it was reached through


def connection() -> tuple[str, str]:
    """This process's present Ray connection: a new cluster has a new node, joining one again a new job."""
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


def reached(service: ActorHandle) -> ActorHandle:
    """Mark the handle `service` as reached through the present Ray connection, so that `service_calls` refuses
    it once the process has left that Ray: a handle or stream of a Ray left behind can abort the process."""
    _REACHED[id(service)] = connection()
    weakref.finalize(service, _REACHED.pop, id(service), None)
    return service


def reachable(service: ActorHandle) -> bool:
    """Whether this process is in a Ray, and in the one `service` was reached through (when `reached` marked it)."""
    if not ray.is_initialized():
        return False
    through = _REACHED.get(id(service))
    return through is None or through == connection()


@contextlib.contextmanager
def service_calls(service: ActorHandle) -> Iterator[None]:
    """Raise `ServiceUnavailable` for the death of `service` itself (a worker's death stays what it was), for
    any error while `rollout.shutdown` stops it, and before any call once this process has left the Ray it reached
    `service` through (where Ray would start a new local cluster, or abort the process on a stale stream)."""
    with _CALLS.cond:
        if _CALLS.closing:
            raise ServiceUnavailable(_SHUT_DOWN)
        if not reachable(service):
            raise ServiceUnavailable(_LEFT_RAY)
        _CALLS.inside += 1
    try:
        yield
    except Exception as err:
        if _CALLS.closing:
            raise ServiceUnavailable(_SHUT_DOWN) from err
        if not isinstance(err, RayActorError) or err.actor_id not in (None, service._actor_id.hex()):
            raise
        raise ServiceUnavailable(
            "the rollout service actor was stopped (`rollout stop`, or `rollout.shutdown()` in the process that "
            "started it), died or is restarting (a detached service that died is restarted by Ray and replays its "
            "latest weights; calls in flight are lost: start them again once it is back, e.g. after "
            f"RolloutClient.connect): {type(err).__name__}") from err
    finally:
        with _CALLS.cond:
            _CALLS.inside -= 1
            _CALLS.cond.notify_all()


@contextlib.contextmanager
def calls_refused() -> Iterator[None]:
    """Inside, every new service call of this process raises `ServiceUnavailable`, and so does every call that
    fails meanwhile (rollout.shutdown stops the service inside, which ends the calls waiting on it)."""
    with _CALLS.cond:
        _CALLS.closing = True
    try:
        yield
    finally:
        with _CALLS.cond:
            _CALLS.closing = False


def wait_for_calls(timeout_s: float = 30.0) -> None:
    """Wait at most `timeout_s` for the threads inside a service call to return (before Ray stops)."""
    with _CALLS.cond:
        _CALLS.cond.wait_for(lambda: _CALLS.inside == 0, timeout_s)

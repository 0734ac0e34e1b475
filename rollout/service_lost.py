"""The callers' view of a dead service actor: Ray's error for it becomes `ServiceUnavailable`, raised at once
by the call that was waiting on the service."""

from __future__ import annotations

import contextlib
import threading
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


@contextlib.contextmanager
def service_calls(service: ActorHandle) -> Iterator[None]:
    """Raise `ServiceUnavailable` for the death of `service` itself (a worker's death stays what it was), for
    any error while `rollout.shutdown` stops it, and before any call once this process has left Ray, where Ray
    would otherwise start a new local cluster."""
    with _CALLS.cond:
        if _CALLS.closing:
            raise ServiceUnavailable(_SHUT_DOWN)
        if not ray.is_initialized():
            raise ServiceUnavailable("this process is no longer connected to Ray (rollout.shutdown() or "
                                     "ray.shutdown() ran), so the rollout service is out of reach: start or join "
                                     "it again with rollout.init() or RolloutClient.connect()")
        _CALLS.inside += 1
    try:
        yield
    except Exception as err:
        if _CALLS.closing:
            raise ServiceUnavailable(_SHUT_DOWN) from err
        if not isinstance(err, RayActorError) or err.actor_id not in (None, service._actor_id.hex()):
            raise
        raise ServiceUnavailable(
            "the rollout service actor was stopped (`rollout stop`), died or is restarting (a detached service "
            "that died is restarted by Ray and replays its latest weights; calls in flight are lost: start them "
            f"again once it is back, e.g. after RolloutClient.connect): {type(err).__name__}") from err
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

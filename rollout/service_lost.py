"""The callers' view of a dead service actor: Ray's error for it becomes `ServiceUnavailable`, raised at once
by the call that was waiting on the service."""

from __future__ import annotations

import contextlib
from typing import Iterator

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError


class ServiceUnavailable(RuntimeError):
    """The rollout service actor died, or is restarting, while a call waited on it; or this process has
    left Ray since it reached the service."""


@contextlib.contextmanager
def service_calls(service: ActorHandle) -> Iterator[None]:
    """Raise `ServiceUnavailable` for the death of `service` itself (a worker's death stays what it was), and
    before any call once this process has left Ray, where Ray would otherwise start a new local cluster."""
    if not ray.is_initialized():
        raise ServiceUnavailable("this process is no longer connected to Ray (rollout.shutdown() or "
                                 "ray.shutdown() ran), so the rollout service is out of reach: start or join it "
                                 "again with rollout.init() or RolloutClient.connect()")
    try:
        yield
    except RayActorError as err:
        if err.actor_id not in (None, service._actor_id.hex()):
            raise
        raise ServiceUnavailable(
            "the rollout service actor died or is restarting (a detached service is restarted by Ray and "
            "replays its latest weights; calls in flight are lost: start them again once it is back, "
            f"e.g. after RolloutClient.connect): {type(err).__name__}") from err

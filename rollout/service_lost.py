"""The callers' view of a dead service actor: Ray's error for it becomes `ServiceUnavailable`, raised at once
by the call that was waiting on the service."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ray.actor import ActorHandle
from ray.exceptions import RayActorError


class ServiceUnavailable(RuntimeError):
    """The rollout service actor died, or is restarting, while a call waited on it."""


@contextlib.contextmanager
def service_calls(service: ActorHandle) -> Iterator[None]:
    """Raise `ServiceUnavailable` for the death of `service` itself (a worker's death stays what it was)."""
    try:
        yield
    except RayActorError as err:
        if err.actor_id not in (None, service._actor_id.hex()):
            raise
        raise ServiceUnavailable(
            "the rollout service actor died or is restarting (a detached service is restarted by Ray and "
            "replays its latest weights; calls in flight are lost: start them again once it is back, "
            f"e.g. after RolloutClient.connect): {type(err).__name__}") from err

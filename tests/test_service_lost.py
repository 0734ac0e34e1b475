"""`service_calls` tells the death of the service actor (`ServiceUnavailable`) from that of another actor, such
as one of its workers, whose error stays what it was. No Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from rollout import service_lost
from rollout.service_lost import ServiceUnavailable, service_calls

SERVICE = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "aa" * 16))


def test_only_the_service_actors_own_death_is_service_unavailable(monkeypatch):
    monkeypatch.setattr(service_lost.ray, "is_initialized", lambda: True)
    with pytest.raises(RayActorError) as error:
        with service_calls(SERVICE):
            raise RayActorError(actor_id="bb" * 16)
    assert not isinstance(error.value, ServiceUnavailable) and error.value.actor_id == "bb" * 16
    stopped = r"actor was stopped \(`rollout stop`, or `rollout.shutdown\(\)` in the process that started it\), died"
    with pytest.raises(ServiceUnavailable, match=stopped):
        with service_calls(SERVICE):
            raise RayActorError(actor_id="aa" * 16)

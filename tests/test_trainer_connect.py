"""`RolloutClient.connect` against stand-in service actors on a private local Ray: it waits through a restart
of the service, names a service that is not ready in its TimeoutError, raises a failed load's own error, and
refuses at once an actor that is no service and arguments that could name none or bound no wait."""

from __future__ import annotations

import asyncio
import math
import os
import re
import sys
from pathlib import Path

import pytest
import ray
from ray.exceptions import RayActorError

from rollout.config import load_service_config
from rollout.local_ray import start_local_ray, stop_local_ray
from trainer_client import RolloutClient

NAMESPACE = "rollout-connect-test"
DEAD_WORKER = "ab" * 16  # the actor id of a service's worker that died


class StandIn:
    """What `connect` takes a service by: its `ready` and `sample` methods (only `ready` is called here)."""

    def sample(self) -> None:
        raise NotImplementedError


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module


@ray.remote(num_cpus=0, max_restarts=1)
class Crashing(StandIn):
    """Crashes in its first `ready` call, as a service that dies just as a trainer connects; Ray restarts it."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def ready(self) -> int:
        if not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        return 2


@ray.remote(num_cpus=0)
class Ready(StandIn):
    """A service that has loaded its engines."""

    async def ready(self) -> int:
        return 2


@ray.remote(num_cpus=0)
class Loading(StandIn):
    """Never finishes loading its engines."""

    async def ready(self) -> int:
        await asyncio.sleep(3600)
        return 2


@ray.remote(num_cpus=0)
class Failed(StandIn):
    """Failed to load its engines."""

    async def ready(self) -> int:
        raise ValueError("engine.model='/nowhere' is not a model directory")


@ray.remote(num_cpus=0)
class WorkerDied(StandIn):
    """One of its workers died while its engine loaded."""

    async def ready(self) -> int:
        raise RayActorError(actor_id=DEAD_WORKER)


@ray.remote(num_cpus=0)
class Worker:
    """A service's worker: named `<name>-worker-<i>` beside its service, with `ready` but no `sample`."""

    async def ready(self) -> int:
        return 1


@pytest.fixture(scope="module")
def cluster(model_dir):
    start_local_ray(load_service_config(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.3,
                                        namespace=NAMESPACE))
    yield
    stop_local_ray()


@pytest.mark.timeout(120)
def test_connect_waits_through_a_restart_of_the_service(cluster, tmp_path):
    actor = Crashing.options(name="crashing", namespace=NAMESPACE).remote(str(tmp_path / "crashed"))
    client = RolloutClient.connect(name="crashing", namespace=NAMESPACE, timeout_s=60)
    assert (tmp_path / "crashed").exists() and ray.get(client.service.ready.remote()) == 2
    ray.kill(actor)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stand_in, name, timeout_s, error, match", [
    (Loading, "loading", 2, TimeoutError, f"rollout service 'loading' in namespace '{NAMESPACE}' is not ready"),
    (Failed, "failed", 10, ValueError, "is not a model directory"),
    (Worker, "svc-worker-0", 30, ValueError, f"the actor 'svc-worker-0' in namespace '{NAMESPACE}' is not a rollout "),
])
def test_connect_says_what_it_found(cluster, stand_in, name, timeout_s, error, match):
    """A service still loading is named in the TimeoutError; one that failed to load raises its own error (not
    Ray's wrapper with the service's traceback); an actor that is no service (a worker's name) is refused at once."""
    actor = stand_in.options(name=name, namespace=NAMESPACE).remote()
    with pytest.raises(error, match=match) as raised:
        RolloutClient.connect(name=name, namespace=NAMESPACE, timeout_s=timeout_s)
    assert raised.type is error
    ray.kill(actor)


@pytest.mark.timeout(60)
def test_a_service_whose_worker_died_while_loading_raises_that_death(cluster):
    """A worker's death is the service's failure to load, raised at once: not the death of the service itself,
    which connect would wait out as a restart."""
    actor = WorkerDied.options(name="worker-died", namespace=NAMESPACE).remote()
    with pytest.raises(RayActorError) as error:
        RolloutClient.connect(name="worker-died", namespace=NAMESPACE, timeout_s=10)
    assert error.value.actor_id == DEAD_WORKER
    ray.kill(actor)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", [math.inf, 1e16])
def test_a_service_reached_without_a_time_limit(cluster, timeout_s):
    """`timeout_s=math.inf`, or one too long for Ray's millisecond wait, waits for good (they overflowed it)."""
    actor = Ready.options(name="ready", namespace=NAMESPACE).remote()
    client = RolloutClient.connect(name="ready", namespace=NAMESPACE, timeout_s=timeout_s)
    assert ray.get(client.service.ready.remote()) == 2
    ray.kill(actor)


@pytest.mark.parametrize("arguments, named", [
    ({"timeout_s": math.nan}, "timeout_s=nan"), ({"timeout_s": -5}, "timeout_s=-5"), ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": "5"}, "timeout_s='5'"), ({"timeout_s": True}, "timeout_s=True"), ({"name": None}, "name=None"),
    ({"name": ""}, "name=''"), ({"namespace": None}, "namespace=None"),
])
def test_arguments_that_name_no_service_or_bound_no_wait_are_refused(arguments, named, monkeypatch):
    """Refused before joining any cluster (nan waited for ever where no service ran, inf overflowed Ray's wait)."""
    monkeypatch.setattr("trainer_client.client.join_cluster", lambda *a: pytest.fail("joined a cluster first"))
    with pytest.raises(ValueError, match=re.escape(named)):
        RolloutClient.connect(**arguments)

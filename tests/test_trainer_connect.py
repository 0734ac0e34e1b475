"""`RolloutClient.connect` against stand-in service actors on a private local Ray: it waits through a restart
of the service, names a service that is not ready in its TimeoutError, and raises a failed load's own error."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import ray
from ray.exceptions import RayActorError

from rollout.config import load_service_config
from rollout.local_ray import start_local_ray, stop_local_ray
from trainer_client import RolloutClient

NAMESPACE = "rollout-connect-test"
DEAD_WORKER = "ab" * 16  # the actor id of a service's worker that died


@ray.remote(num_cpus=0, max_restarts=1)
class Crashing:
    """Crashes in its first `ready` call, as a service that dies just as a trainer connects; Ray restarts it."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def ready(self) -> int:
        if not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        return 2


@ray.remote(num_cpus=0)
class Loading:
    """Never finishes loading its engines."""

    async def ready(self) -> int:
        await asyncio.sleep(3600)
        return 2


@ray.remote(num_cpus=0)
class Failed:
    """Failed to load its engines."""

    async def ready(self) -> int:
        raise ValueError("engine.model='/nowhere' is not a model directory")


@ray.remote(num_cpus=0)
class WorkerDied:
    """One of its workers died while its engine loaded."""

    async def ready(self) -> int:
        raise RayActorError(actor_id=DEAD_WORKER)


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
def test_a_service_still_loading_is_named_in_the_timeout(cluster):
    actor = Loading.options(name="loading", namespace=NAMESPACE).remote()
    with pytest.raises(TimeoutError, match=f"rollout service 'loading' in namespace '{NAMESPACE}' is not ready"):
        RolloutClient.connect(name="loading", namespace=NAMESPACE, timeout_s=2)
    ray.kill(actor)


@pytest.mark.timeout(60)
def test_a_service_that_failed_to_load_raises_its_error(cluster):
    actor = Failed.options(name="failed", namespace=NAMESPACE).remote()
    with pytest.raises(ValueError, match="is not a model directory") as error:
        RolloutClient.connect(name="failed", namespace=NAMESPACE, timeout_s=10)
    assert error.type is ValueError  # not Ray's wrapper with the service's traceback
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

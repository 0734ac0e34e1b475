"""A dead service actor: callers of a killed service get `ServiceUnavailable` at once; a detached service
(`rollout serve --detach`) is restarted by Ray, starts new workers, replays the latest weights (here an
object-store update, kept alive by the service's weight keeper) and serves new calls."""

from __future__ import annotations

import os
import time

import pytest
import ray

from rollout.config import load_service_config
from rollout.local_ray import start_local_ray
from rollout.service import launch, stop
from rollout.service_lost import ServiceUnavailable
from tests.conftest import hf_model, random_prompts
from trainer_client import RolloutClient

PROMPTS = random_prompts(6, 512, (4, 12), seed=41)
NAME, NAMESPACE = "restart-test", "rollout-restart-test"


@pytest.fixture(scope="module")
def service(model_dir):
    config = load_service_config(model=model_dir("qwen3"), num_workers=2, name=NAME, namespace=NAMESPACE,
                                 flush_rows=2, flush_delay_s=0.01, max_num_seqs=4, num_blocks=64,
                                 object_store_memory_gib=0.5)
    start_local_ray(config)
    handle = launch(config, detached=True)
    yield handle
    stop(handle)
    with pytest.raises(ValueError):  # stop ends the weight keeper too
        ray.get_actor(f"{NAME}-weights", namespace=NAMESPACE)
    ray.shutdown()


def pid_of(name: str) -> int:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).__ray_call__.remote(lambda actor: os.getpid()))


def wait_until_back(client: RolloutClient) -> dict[int, dict]:
    deadline = time.monotonic() + 120
    while True:
        try:
            stats = client.stats()
            if sorted(stats) == [0, 1]:
                return stats
        except ServiceUnavailable:
            pass
        assert time.monotonic() < deadline, "the detached service did not come back"
        time.sleep(0.5)


@pytest.mark.timeout(240)
def test_a_killed_detached_service_comes_back_with_its_weights(service, model_dir):
    client = RolloutClient(service)
    client.update_weights(hf_model(model_dir("qwen3", seed=1)).state_dict(), version=1)  # through the object store
    before = {name: pid_of(name) for name in [NAME, f"{NAME}-worker-0", f"{NAME}-worker-1"]}

    batches = iter(client.sample(PROMPTS, n=4, max_new_tokens=48, ignore_eos=True))
    next(batches)
    ray.kill(service, no_restart=False)  # a crash: Ray restarts a detached service
    with pytest.raises(ServiceUnavailable, match="died or is restarting"):
        list(batches)

    stats = wait_until_back(client)
    assert {s["policy_version"] for s in stats.values()} == {1}
    after = {name: pid_of(name) for name in before}
    assert all(after[name] != before[name] for name in before)  # a new service process with new workers

    table = client.sample(PROMPTS, n=2, max_new_tokens=8).to_table()
    assert sorted(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist())) == [
        (p, s) for p in range(6) for s in range(2)]
    assert set(table.column("policy_version").to_pylist()) == {1}
    assert set(table.column("worker_id").to_pylist()) == {0, 1}

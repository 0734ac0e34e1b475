"""A dead service actor. A detached service started by `rollout serve --detach` (a subprocess joining the Ray on
127.0.0.1 that this module starts) is killed, and Ray restarts it: it starts new workers, replays the latest
weight update from its weight keeper (object store, checkpoint) and serves new calls; a replay source that is
gone leaves the model's own weights as version 0. Calls on a service that dies, or is dead, get
`ServiceUnavailable` at once; `rollout stop` ends the service, its workers and its keeper for good."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import ray
from ray.exceptions import RayActorError

from rollout.config import load_service_config
from rollout.local_ray import start_local_ray, stop_local_ray
from rollout.service import actor_exists, stop
from rollout.service_lost import ServiceUnavailable
from rollout.weight_keeper import start_keeper, stop_keeper
from tests.conftest import hf_greedy, hf_model, random_prompts
from trainer_client import RolloutClient
from workers.messages import WeightUpdate

PROMPTS = random_prompts(6, 512, (4, 12), seed=41)
NAME, NAMESPACE = "restart-test", "rollout-restart-test"
KEEPER, WORKERS = f"{NAME}-weights", [f"{NAME}-worker-0", f"{NAME}-worker-1"]
SERVICE = dict(num_workers=2, name=NAME, namespace=NAMESPACE, flush_rows=2, flush_delay_s=0.01, max_num_seqs=4,
               num_blocks=64)


def cli(command: list[str], model: str, status: int = 0) -> str:
    """Run `rollout COMMAND` for this module's service in a fresh process, which must exit with `status`;
    returns what it printed (on stderr too, for a failure)."""
    sets = [arg for field, value in SERVICE.items() for arg in ("--set", f"{field}={json.dumps(value)}")]
    argv = [sys.executable, "-m", "rollout.cli", *command, "--model", model, *sets,
            "--address", ray.get_runtime_context().gcs_address]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)  # inherits the Ray token
    assert done.returncode == status, done.stderr[-3000:]
    return done.stdout if status == 0 else done.stderr


@pytest.fixture(scope="module")
def service(model_dir):
    config = load_service_config(model=model_dir("qwen3"), object_store_memory_gib=0.5, **SERVICE)
    start_local_ray(config)
    try:
        printed = cli(["serve", "--detach"], model_dir("qwen3"))  # returns once the service is ready
        assert f"rollout service {NAME!r} ready in namespace {NAMESPACE!r} with 2 workers" in printed
        yield ray.get_actor(NAME, namespace=NAMESPACE)
    finally:
        with contextlib.suppress(ValueError):  # a test failed before `rollout stop`
            stop(ray.get_actor(NAME, namespace=NAMESPACE))
        stop_keeper(config)
        stop_local_ray()  # ends every process of this Ray


def pid_of(name: str) -> int:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).__ray_call__.remote(lambda actor: os.getpid()))


def kill_service(service: ray.actor.ActorHandle) -> None:
    """Kill the service as a crash would, and return once Ray has started its new process (not yet ready)."""
    before = pid_of(NAME)
    ray.kill(service, no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(RayActorError):  # restarting
            if pid_of(NAME) != before:
                return
        assert time.monotonic() < deadline, "Ray did not restart the service"
        time.sleep(0.2)


def wait_until_back(client: RolloutClient) -> dict[int, dict]:
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(ServiceUnavailable):
            stats = client.stats()
            if sorted(stats) == [0, 1]:
                return stats
        assert time.monotonic() < deadline, "the detached service did not come back"
        time.sleep(0.5)


def greedy(client: RolloutClient, new: int = 8) -> list[dict]:
    """One greedy sample of every prompt, in prompt order; checks that both workers served."""
    table = client.sample(PROMPTS, n=1, temperature=0.0, max_new_tokens=new, ignore_eos=True).to_table()
    assert set(table.column("worker_id").to_pylist()) == {0, 1}
    return table.to_pylist()


def assert_serves(client: RolloutClient, model: str, version: int) -> None:
    """Every worker holds `version`, and greedy samples are those of the model `model`."""
    assert {s["policy_version"] for s in wait_until_back(client).values()} == {version}
    rows = greedy(client)
    assert [r["token_ids"] for r in rows] == [hf_greedy(model, p, 8) for p in PROMPTS]
    assert {r["policy_version"] for r in rows} == {version}


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process `pid` stopped by SIGSTOP while inside the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class Call(threading.Thread):
    """A blocking call run in the background; `error` is what it raised."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call, self.error = call, None

    def run(self) -> None:
        try:
            self.call()
        except BaseException as err:
            self.error = err


def assert_logged(message: str) -> None:
    """`message` appears in a log file of this Ray session (the service's stderr lands there)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    deadline = time.monotonic() + 30
    while not any(message in path.read_text(errors="replace") for path in logs.glob("worker-*.err")):
        assert time.monotonic() < deadline, f"{message!r} was not logged"
        time.sleep(0.5)


@pytest.mark.timeout(240)
def test_a_killed_detached_service_comes_back_with_its_weights(service, model_dir):
    """An object-store update: the keeper borrows the trainer's ref. A stream in flight fails at once."""
    client = RolloutClient(service)
    policy = model_dir("qwen3", seed=1)
    client.update_weights(hf_model(policy).state_dict(), version=1)
    before = {name: pid_of(name) for name in [NAME, *WORKERS]}

    batches = iter(client.sample(PROMPTS, n=4, max_new_tokens=48, ignore_eos=True))
    next(batches)
    ray.kill(service, no_restart=False)  # a crash: Ray restarts a detached service
    with pytest.raises(ServiceUnavailable, match="died or is restarting"):
        list(batches)

    assert_serves(client, policy, 1)
    after = {name: pid_of(name) for name in before}
    assert all(after[name] != before[name] for name in before)  # a new service process with new workers
    table = client.sample(PROMPTS, n=2, max_new_tokens=8).to_table()
    assert sorted(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist())) == [
        (p, s) for p in range(6) for s in range(2)]


@pytest.mark.timeout(240)
def test_checkpoint_replay_and_calls_on_a_service_that_dies_while_restarting(service, model_dir):
    """A checkpoint update is replayed from its path. While the restarted service prepares (here held up
    by a frozen keeper), calls wait for it; when it dies again they raise ServiceUnavailable at once."""
    client = RolloutClient(service)
    policy = model_dir("qwen3", seed=2)
    client.update_weights(policy, version=2)
    with frozen(pid_of(KEEPER)):  # the restarted service cannot recall its weights, so it is never ready
        kill_service(service)
        calls = [Call(client.stats), Call(lambda: client.update_weights(model_dir("qwen3", seed=1), version=3))]
        for call in calls:
            call.start()
        time.sleep(1.0)
        assert all(call.is_alive() for call in calls), "calls wait while the restarted service prepares"
        ray.kill(service, no_restart=False)
        for call in calls:
            call.join(timeout=60)
            assert not call.is_alive(), "a call on a dead service hangs"
            assert isinstance(call.error, ServiceUnavailable), repr(call.error)
    assert_serves(client, policy, 2)


@pytest.mark.timeout(240)
def test_broadcast_replay_from_the_keepers_copy(service, model_dir):
    """A broadcast update is replayed from a copy a worker exported to the keeper; the group itself is gone."""
    client = RolloutClient(service)
    policy, state = model_dir("qwen3", seed=1), hf_model(model_dir("qwen3", seed=1)).state_dict()
    client.init_weight_sync()  # gloo, the trainer's store on 127.0.0.1
    client.update_weights(state, version=4, transport="broadcast")
    kill_service(service)
    assert_serves(client, policy, 4)
    with pytest.raises(RuntimeError, match="call init_weight_sync"):
        client.update_weights(state, version=5, transport="broadcast")
    client.init_weight_sync()
    client.update_weights(hf_model(model_dir("qwen3", seed=2)).state_dict(), version=5, transport="broadcast")
    assert_serves(client, model_dir("qwen3", seed=2), 5)


@pytest.mark.timeout(240)
def test_a_replay_source_that_is_gone_leaves_the_models_own_weights(service, model_dir, tmp_path):
    """A checkpoint deleted before the crash: an error is logged, the workers serve the model as version 0."""
    client = RolloutClient(service)
    checkpoint = shutil.copytree(model_dir("qwen3", seed=2), tmp_path / "deleted")
    client.update_weights(checkpoint, version=6)
    shutil.rmtree(checkpoint)
    kill_service(service)
    assert_serves(client, model_dir("qwen3"), 0)
    assert_logged("could not replay weights version 6 after a restart")
    client.update_weights(model_dir("qwen3", seed=1), version=7)  # updates work again
    assert {s["policy_version"] for s in client.stats().values()} == {7}


@pytest.mark.timeout(120)
def test_a_keeper_left_by_an_earlier_service_is_replaced_empty(service, model_dir):
    """A new service of a name whose keeper outlived its service never replays that keeper's stale weights."""
    config = load_service_config(model=model_dir("qwen3"), name="stale", namespace=NAMESPACE)
    stale = start_keeper(config)
    ray.get(stale.keep.remote(WeightUpdate(version=9, mode="continue", transport="checkpoint", tensors=[],
                                           path="/old")))
    try:
        assert ray.get(start_keeper(config).recall.remote()) is None
        with pytest.raises(RayActorError):
            ray.get(stale.recall.remote())
    finally:
        stop_keeper(config)


@pytest.mark.timeout(240)
def test_rollout_stop_ends_it_for_good(service, model_dir):
    """Runs last: the service, its workers and its keeper are gone, and calls on its handle fail at once."""
    client = RolloutClient(service)
    assert f"rollout service {NAME!r} stopped" in cli(["stop"], model_dir("qwen3"))
    deadline = time.monotonic() + 30
    while left := [name for name in [NAME, KEEPER, *WORKERS] if actor_exists(name, NAMESPACE)]:
        assert time.monotonic() < deadline, f"still running after `rollout stop`: {left}"
        time.sleep(0.2)
    for call in [client.stats, lambda: client.update_weights(model_dir("qwen3", seed=1), version=8),
                 lambda: client.sample(PROMPTS, n=1), client.init_weight_sync]:
        with pytest.raises(ServiceUnavailable, match="died or is restarting"):
            call()
    assert f"no service {NAME!r} runs in namespace {NAMESPACE!r}" in cli(["stop"], model_dir("qwen3"), status=1)

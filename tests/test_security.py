"""Security of the embedded service: every process of its local Ray listens on loopback only, its GCS refuses
clients without the instance's own token, and a model's own Python code never runs unless
`EngineConfig.trust_remote_code=True`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import ray
import transformers
from ray._private import ray_constants

import rollout
from rollout import local_ray
from rollout.config import load_service_config
from rollout.local_ray import start_local_ray, stop_local_ray
from rollout.service_lost import ServiceUnavailable
from tests.conftest import make_engine
from trainer_client import RolloutClient

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
GCS_CLIENT = textwrap.dedent("""
    import sys
    from ray._raylet import GcsClient
    print(len(GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=10)))
""")


def test_the_local_ray_has_a_token_of_its_own_and_restores_the_callers(model_dir, monkeypatch):
    """Runs before the module's service starts: the caller's token and cluster settings come back once it
    stops (a later driver of the process may join a cluster that is not on 127.0.0.1)."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "mine")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    start_local_ray(load_service_config(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.3))
    try:
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN"] != "mine"
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and not ray_constants.ENABLE_RAY_CLUSTER
        first = os.environ["RAY_AUTH_TOKEN"]
    finally:
        stop_local_ray()
    assert os.environ["RAY_AUTH_TOKEN"] == "mine" and "RAY_AUTH_MODE" not in os.environ
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and ray_constants.ENABLE_RAY_CLUSTER
    start_local_ray(load_service_config(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.3))
    try:
        assert os.environ["RAY_AUTH_TOKEN"] not in (first, "mine")  # a fresh one per instance
        assert ray.cluster_resources()["CPU"] >= 1  # this process's driver authenticated with it
    finally:
        stop_local_ray()


def test_a_stream_or_client_used_after_shutdown_starts_no_ray(model_dir):
    """Runs before the module's service starts: after `rollout.shutdown()`, an open stream and a client
    raise ServiceUnavailable instead of letting Ray start a new local cluster (with a dashboard and a
    world-readable token file) behind the caller's back."""
    rollout.init(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.3)
    try:
        client = RolloutClient.connect(name="rollout", namespace="rollout")
        stream = rollout.sample([[5, 6, 7]], n=2, max_new_tokens=50, ignore_eos=True)
    finally:
        rollout.shutdown()
    for call in (lambda: list(stream), client.stats, lambda: client.sample([[5, 6]], n=1)):
        with pytest.raises(ServiceUnavailable, match="no longer connected to the Ray it reached"):
            call()
        assert not ray.is_initialized()


@pytest.fixture(scope="module")
def service(model_dir):
    rollout.init(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.3)
    yield ray.get_runtime_context().gcs_address
    rollout.shutdown()


def listening(process: psutil.Process) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket and bound UDP socket of `process`."""
    return [(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr)]


def listeners_of_this_process_tree() -> dict[str, list[tuple[str, int]]]:
    """The listening sockets of this process and every process below it (Ray's daemons and workers)."""
    sockets = {}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            sockets[f"{process.pid} {process.name()}"] = listening(process)
        except psutil.NoSuchProcess:
            continue
    return sockets


def beyond_loopback(sockets: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    return {name: s for name, s in sockets.items() if any(ip not in LOOPBACK for ip, _ in s)}


def test_every_process_of_the_local_ray_listens_on_loopback_only(service):
    sockets = listeners_of_this_process_tree()
    names = " ".join(sockets)
    assert "gcs_server" in names and "raylet" in names and "RolloutWorker" in names, names
    assert sum(map(len, sockets.values())) >= 5  # GCS, raylet, agents, workers: the scan saw them
    assert not beyond_loopback(sockets), f"listening beyond loopback: {beyond_loopback(sockets)}"


def test_the_local_rays_session_directory_is_this_users_alone(service):
    """Ray's default /tmp/ray is writable by every local user, who could read its logs and put a socket of
    theirs in place of the object store's; the embedded Ray's session lives under a 0700 directory."""
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    private = session.parents[1]
    assert private.name.startswith("rollout-ray-") and private.stat().st_mode & 0o777 == 0o700
    assert (session / "sockets").is_dir()


def test_auto_trusts_a_head_address_only_in_this_users_own_file(tmp_path, monkeypatch):
    """`auto` reads the head address `ray start` left in Ray's temp directory, which any local user may
    write: a file that others could have written is refused, so the cluster token never goes to their server."""
    path = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(local_ray, "get_ray_address_file", lambda temp_dir: str(path))
    assert local_ray._address_left_by_ray_start() is None
    path.write_text("127.0.0.1:6379")
    path.chmod(0o644)
    assert local_ray._address_left_by_ray_start() == "127.0.0.1:6379"
    path.chmod(0o666)
    with pytest.raises(ConnectionError, match="is not this user's own file"):
        local_ray._address_left_by_ray_start()


def gcs_client(gcs: str, **env: str | None) -> subprocess.CompletedProcess:
    """A separate process asking the GCS for its keys, with `env` changed (None removes a variable)."""
    changed = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", GCS_CLIENT, gcs], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in changed.items() if v is not None})


def test_the_gcs_refuses_clients_without_the_instance_token(service, tmp_path):
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    allowed = gcs_client(service)
    assert allowed.returncode == 0 and int(allowed.stdout) > 0, allowed.stderr[-2000:]

    other_file = tmp_path / "token"
    other_file.write_text("f" * 64)
    for env in [dict(RAY_AUTH_TOKEN="0" * 64), dict(RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN=None),
                dict(RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=str(other_file))]:
        refused = gcs_client(service, **env)
        assert refused.returncode != 0 and "AuthenticationError" in refused.stderr, (env, refused.stderr[-2000:])


CUSTOM_CODE = textwrap.dedent("""
    import os
    from transformers import Qwen3Config, Qwen3ForCausalLM

    open(os.environ["ROLLOUT_TEST_MARKER"], "w").close()  # proof that this file was executed


    class CustomConfig(Qwen3Config):
        model_type = "tiny_custom"


    class CustomModel(Qwen3ForCausalLM):
        config_class = CustomConfig
""")


@pytest.fixture
def custom_model(model_dir, tmp_path, monkeypatch):
    """A copy of the tiny model whose config.json maps its classes to a Python file of its own."""
    path = tmp_path / "custom-model"
    shutil.copytree(model_dir("qwen3"), path)
    (path / "custom_code.py").write_text(CUSTOM_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoConfig": "custom_code.CustomConfig",
                                                      "AutoModelForCausalLM": "custom_code.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "executed"
    monkeypatch.setenv("ROLLOUT_TEST_MARKER", str(marker))
    return str(path), marker


def test_a_models_own_code_runs_only_with_trust_remote_code(custom_model):
    path, marker = custom_model
    with pytest.raises(ValueError, match=r"runs only with EngineConfig.trust_remote_code=True"):
        make_engine(path)
    assert not marker.exists()
    # trusted, the custom config class is loaded (its code ran); the engine then refuses the unverified type
    with pytest.raises(ValueError, match=r"model type 'tiny_custom' is not supported by the rollout engine"):
        make_engine(path, trust_remote_code=True)
    assert marker.exists()


def test_a_models_own_code_for_a_served_type_is_refused_before_its_weights_load(custom_model, monkeypatch):
    """A checkpoint of a type the engine serves whose auto_map names a model class of its own: trusted, that
    class would replace transformers' code, which is what the engine is verified against."""
    path, marker = custom_model
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config.update(model_type="qwen3", auto_map={"AutoModelForCausalLM": "custom_code.CustomModel"})
    config_path.write_text(json.dumps(config))
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=r"model type 'qwen3' .* own modelling "
                                                        r"code \(auto_map AutoModelForCausalLM='custom_code"):
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # no weights may load
        make_engine(path, trust_remote_code=True)
    assert type(make_engine(path).runner.model) is transformers.Qwen3ForCausalLM and not marker.exists()

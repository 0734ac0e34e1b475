"""Job submission end to end: a local Ray head (127.0.0.1, with the dashboard), `rollout serve` submitted
with JobSubmissionClient, a separate driver process sampling through RolloutClient, then the job stopped
and every process this test started ended by its PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

CLIENT_SCRIPT = textwrap.dedent("""
    import json, sys
    from trainer_client import RolloutClient
    client = RolloutClient.connect(name="job-test", namespace="rollout-job-test", address=sys.argv[1],
                                   timeout_s=120)
    table = client.sample(["The quick brown fox", [5, 6, 7]], n=3, max_new_tokens=6).to_table()
    print(json.dumps({"rows": table.num_rows, "workers": sorted(set(table.column("worker_id").to_pylist())),
                      "keys": list(zip(table.column("prompt_index").to_pylist(),
                                       table.column("sample_index").to_pylist()))}))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root: int) -> set[int]:
    """PIDs of every living process below `root` (from /proc), so that they can be ended by PID."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def end_processes(pids: set[int], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def ray_head():
    """A Ray head with the dashboard, everything on 127.0.0.1, its own token; yields (gcs, dashboard, env).
    Afterwards every process below the head is ended by its PID."""
    port, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": uuid.uuid4().hex,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}  # this venv's ray
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--num-cpus=3", "--object-store-memory=300000000", f"--temp-dir={temp_dir}",
         "--disable-usage-stats"], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env
    finally:
        started = {head.pid} | descendants(head.pid)  # Ray's daemons, workers and the job's driver
        end_processes(started)
        head.wait(timeout=10)
        assert not [pid for pid in started if alive(pid)]


def job_client(dashboard: str, env: dict, timeout_s: float = 90.0) -> JobSubmissionClient:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client = JobSubmissionClient(dashboard, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
            client.list_jobs()
            return client
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_submit_serve_connect_sample_stop(ray_head, model_dir, tmp_path):
    gcs, dashboard, env = ray_head
    config = tmp_path / "service.toml"
    config.write_text(f'num_workers = 2\nname = "job-test"\nnamespace = "rollout-job-test"\n'
                      f'[engine]\nmodel = "{model_dir("qwen3")}"\ndevice = "cpu"\n')
    jobs = job_client(dashboard, env)
    job = jobs.submit_job(entrypoint=f"rollout serve --config {config}")

    # the trainer's environment lacks the loopback-only switch: connect joins on 127.0.0.1 by itself
    trainer_env = {k: v for k, v in env.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    driver = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, gcs], env=trainer_env,
                            capture_output=True, text=True, timeout=240)
    assert driver.returncode == 0, driver.stderr[-3000:] + jobs.get_job_logs(job)[-3000:]
    result = json.loads(driver.stdout.strip().splitlines()[-1])
    assert result["rows"] == 6 and result["workers"] == [0, 1]
    assert sorted(map(tuple, result["keys"])) == [(p, s) for p in range(2) for s in range(3)]
    assert "ready in namespace 'rollout-job-test' with 2 workers" in jobs.get_job_logs(job)

    jobs.stop_job(job)
    deadline = time.monotonic() + 60
    while jobs.get_job_status(job) not in {JobStatus.STOPPED, JobStatus.FAILED, JobStatus.SUCCEEDED}:
        assert time.monotonic() < deadline, "the job did not stop"
        time.sleep(0.5)
    assert jobs.get_job_status(job) == JobStatus.STOPPED
    print(jobs.get_job_logs(job))

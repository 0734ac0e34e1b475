"""A dead caller: when the process that called `sample` (a driver, or a trainer actor of a live job) is killed
mid-call, the service notices (it looks its callers up in Ray's GCS every `POLL_S`), aborts the call's requests
on every worker and frees their blocks, and keeps serving."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import ray

import rollout
from tests.conftest import random_prompts
from trainer_client import RolloutClient

PROMPTS = random_prompts(8, 512, (4, 12), seed=31)
SAMPLES, NEW_TOKENS = 4, 900

DRIVER = textwrap.dedent("""
    import json, sys, time
    from trainer_client import RolloutClient
    client = RolloutClient.connect(name="rollout", namespace="rollout", address=sys.argv[1], timeout_s=60)
    stream = client.sample(json.loads(sys.argv[2]), n=int(sys.argv[3]), max_new_tokens=int(sys.argv[4]),
                           ignore_eos=True)
    print("queued", flush=True)
    time.sleep(600)  # holds the call open, reading nothing, until it is killed
""")


@pytest.fixture(scope="module")
def client(model_dir):
    rollout.init(model=model_dir("qwen3"), num_workers=2, flush_rows=4, flush_delay_s=0.02, max_num_seqs=4,
                 num_blocks=256, object_store_memory_gib=0.5)
    yield RolloutClient.connect(name="rollout", namespace="rollout")
    rollout.shutdown()


def decoded(client: RolloutClient) -> int:
    return sum(s["decode_tokens"] for s in client.stats().values())


@pytest.mark.timeout(180)
def test_a_killed_driver_has_its_call_aborted_and_blocks_freed(client):
    before = decoded(client)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, ray.get_runtime_context().gcs_address, json.dumps(PROMPTS), str(SAMPLES),
         str(NEW_TOKENS)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "queued", "the driver could not start its call"
        deadline = time.monotonic() + 60
        while not all(s["running"] for s in client.stats().values()):  # both workers generate its samples
            assert time.monotonic() < deadline, "the driver's call never ran on both workers"
            time.sleep(0.1)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        assert_aborted(client, before)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer actor that starts a call and holds it open, reading nothing."""

    def start(self, prompts: list[list[int]], n: int, new_tokens: int) -> None:
        client = RolloutClient.connect(name="rollout", namespace="rollout")
        self.stream = client.sample(prompts, n=n, max_new_tokens=new_tokens, ignore_eos=True)


@pytest.mark.timeout(180)
def test_a_killed_trainer_actor_has_its_call_aborted_while_its_job_lives(client):
    """The job (this test's driver) lives on: only the caller's own worker record shows it dead."""
    before = decoded(client)
    trainer = Trainer.remote()
    ray.get(trainer.start.remote(PROMPTS, SAMPLES, NEW_TOKENS), timeout=60)
    ray.kill(trainer, no_restart=True)
    assert_aborted(client, before)


def assert_aborted(client: RolloutClient, before: int) -> None:
    """The dead caller's call ends on every worker with its blocks freed, far short of the tokens it asked for
    (`before` were decoded before it started), and the service serves on."""
    deadline = time.monotonic() + 60
    while True:
        stats = client.stats()
        if all(s["running"] == s["waiting"] == s["outstanding"] == 0 for s in stats.values()):
            break
        assert time.monotonic() < deadline, f"the dead caller's call still runs: {stats}"
        time.sleep(0.2)
    for stats in client.stats().values():
        assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]
        assert stats["offloaded"] == 0
    assert decoded(client) - before < len(PROMPTS) * SAMPLES * NEW_TOKENS / 2
    table = rollout.sample(PROMPTS[:2], n=2, max_new_tokens=4).to_table()
    assert table.num_rows == 4 and set(table.column("worker_id").to_pylist()) == {0, 1}

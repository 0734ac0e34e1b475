"""Failures: a request the KV cache cannot hold fails at its call only; a worker killed in the middle of a
stream has the samples it still owed resent to the survivor, every sample arrives exactly once, and the
killed worker is replaced."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import ray

import rollout
from tests.conftest import hf_greedy, random_prompts
from trainer_client import RolloutClient


@pytest.fixture(scope="module")
def service(model_dir):
    model = model_dir("qwen3")
    rollout.init(model=model, num_workers=2, flush_rows=2, flush_delay_s=0.01, max_num_seqs=4,
                 num_blocks=40, object_store_memory_gib=0.5)
    yield model
    rollout.shutdown()


def test_a_request_too_big_for_the_kv_cache_fails_at_its_call_only(service):
    too_big = random_prompts(1, 512, (700, 700), seed=9)  # 40 blocks of 16 tokens hold 640
    with pytest.raises(ValueError, match="num_blocks=40"):
        rollout.sample(too_big, n=1, max_new_tokens=4)
    table = rollout.sample(random_prompts(2, 512, (5, 9), seed=10), n=2, max_new_tokens=4).to_table()
    assert table.num_rows == 4 and set(table.column("worker_id").to_pylist()) == {0, 1}


def test_killed_worker_samples_are_resent_exactly_once(service):
    client = RolloutClient.connect(name="rollout", namespace="rollout")
    prompts = random_prompts(8, 512, (4, 12), seed=7)
    batches = iter(rollout.sample(prompts, n=4, max_new_tokens=48, ignore_eos=True))
    received = [next(batches)]
    owing = {w: s["outstanding"] for w, s in client.stats().items()}
    victim = max(owing, key=owing.get)
    assert owing[victim] > 0
    ray.kill(ray.get_actor(f"rollout-worker-{victim}", namespace="rollout"), no_restart=True)
    received += list(batches)

    rows = [row for batch in received for row in batch.to_pylist()]
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == [
        (p, s) for p in range(8) for s in range(4)]
    assert sum(r["worker_id"] == victim for r in rows) < 16  # some of its samples came from the survivor
    assert all(len(r["token_ids"]) == 48 and r["finish_reason"] == "length" for r in rows)

    deadline = time.monotonic() + 60
    while sorted(client.stats()) != [0, 1]:  # the replacement takes work once its engine has loaded
        assert time.monotonic() < deadline, "the killed worker was not replaced"
        time.sleep(0.2)
    again = rollout.sample(prompts[:2], n=2, max_new_tokens=4).to_table()
    assert again.num_rows == 4 and set(again.column("worker_id").to_pylist()) == {0, 1}


def test_a_replacement_refuses_a_checkpoint_rewritten_since_its_update(service, model_dir, tmp_path):
    """A replacement worker loads the latest checkpoint update again: from a directory the trainer had reused
    since, it served other weights under that update's version (rows labelled alike, tokens not). It refuses
    the directory (the slot stays empty, logged), so every row of that version comes from its weights; the
    next update fills the slot again."""
    policy, checkpoint = model_dir("qwen3", seed=1), tmp_path / "checkpoint"
    shutil.copytree(policy, checkpoint)
    rollout.update_weights(checkpoint, 7)
    shutil.copy(Path(service) / "model.safetensors", checkpoint / "model.safetensors")  # the next checkpoint
    killed = ray.get_actor("rollout-worker-0", namespace="rollout")
    ray.kill(killed, no_restart=True)
    pool = ray.get_actor("rollout", namespace="rollout").__ray_call__
    deadline = time.monotonic() + 60
    # until the service noticed the loss, then replaced worker 0 or gave up
    while ray.get(pool.remote(lambda actor: bool(actor.pool.replacing) or actor.pool.workers.get(0) == killed)):
        assert time.monotonic() < deadline, "worker 0 was neither replaced nor given up"
        time.sleep(0.2)
    prompts = random_prompts(4, 512, (6, 12), seed=11)
    rows = rollout.sample(prompts, n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True).to_table().to_pylist()
    assert all(r["policy_version"] == 7 for r in rows)
    assert [r["token_ids"] for r in rows] == [hf_greedy(policy, p, 6) for p in prompts]

    rollout.update_weights(checkpoint, 8)  # the next update fills the empty slot again
    client = RolloutClient.connect(name="rollout", namespace="rollout")
    while sorted(stats := client.stats()) != [0, 1]:
        assert time.monotonic() < deadline + 60, "worker 0's slot was not filled again after the next update"
        time.sleep(0.2)
    assert {s["policy_version"] for s in stats.values()} == {8}
    rows = rollout.sample(prompts, n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True).to_table().to_pylist()
    assert {r["worker_id"] for r in rows} == {0, 1}
    assert [r["token_ids"] for r in rows] == [hf_greedy(service, p, 6) for p in prompts]

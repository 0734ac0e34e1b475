"""A multi-node cluster simulated on one machine (`ray.cluster_utils.Cluster`: a head without CPUs and two
2-CPU nodes, every raylet on 127.0.0.1) with the workers spread across the nodes: a weight update reaches
every node, placement that cannot be satisfied fails naming what was asked, and removing a node in the middle
of a call still delivers every sample exactly once, its worker replaced on the remaining node."""

from __future__ import annotations

import time

import pytest
import ray
from ray._private.state import actors
from ray.cluster_utils import Cluster

import rollout
from rollout.config import load_service_config
from rollout.local_ray import join_cluster
from rollout.service import launch
from tests.conftest import make_engine, random_prompts
from tests.test_security import beyond_loopback, listeners_of_this_process_tree
from trainer_client import RolloutClient

NODE = dict(node_ip_address="127.0.0.1", object_store_memory=80 * 2**20)


@pytest.fixture(scope="module")
def cluster():
    """The head (no CPUs: workers go to the other nodes) and two nodes of 2 CPUs, joined by this driver."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, **NODE))
    try:
        nodes = [cluster.add_node(num_cpus=2, **NODE) for _ in range(2)]
        join_cluster(cluster.address, "rollout")
        yield cluster, nodes
    finally:
        rollout.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def service(cluster, model_dir):
    rollout.init(model=model_dir("qwen3"), num_workers=2, placement_strategy="SPREAD", flush_rows=2,
                 flush_delay_s=0.01, max_num_seqs=4, num_blocks=64)
    return RolloutClient.connect(name="rollout", namespace="rollout")


def actor_nodes() -> dict[str, str]:
    """Node id of every live actor, by actor name (workers: rollout-worker-I, the service: rollout)."""
    return {a["Name"]: a["Address"]["NodeID"] for a in actors().values() if a["State"] == "ALIVE" and a["Name"]}


def test_a_weight_update_reaches_the_workers_on_every_node(cluster, service, model_dir):
    _, nodes = cluster
    placed = actor_nodes()
    assert {placed["rollout-worker-0"], placed["rollout-worker-1"]} == {n.node_id for n in nodes}
    sockets = listeners_of_this_process_tree()
    assert len(sockets) > 6 and not beyond_loopback(sockets), beyond_loopback(sockets)

    new_model = model_dir("qwen3", seed=1)  # same shapes, other random weights
    rollout.update_weights(new_model, version=1)
    assert {w: s["policy_version"] for w, s in service.stats().items()} == {0: 1, 1: 1}

    prompts = random_prompts(8, 512, (4, 12), seed=11)
    params = dict(n=1, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    table = rollout.sample(prompts, **params).to_table()
    assert set(table.column("worker_id").to_pylist()) == {0, 1}
    assert set(table.column("policy_version").to_pylist()) == {1}
    expected = make_engine(new_model).generate(prompts, rollout.SamplingParams(**params))
    old = make_engine(model_dir("qwen3")).generate(prompts, rollout.SamplingParams(**params))
    assert table.column("token_ids").to_pylist() == expected.column("token_ids").to_pylist()
    assert expected.column("token_ids").to_pylist() != old.column("token_ids").to_pylist()


@pytest.mark.parametrize("workers, strategy, asked", [
    (5, "SPREAD", r"5 workers of \{'CPU': 1.0\} within 1.0 s \(strategy SPREAD\)"),
    (3, "STRICT_SPREAD", r"3 workers of \{'CPU': 1.0\} within 1.0 s \(strategy STRICT_SPREAD\)"),
])
def test_placement_that_cannot_be_satisfied_fails_naming_it(service, model_dir, workers, strategy, asked):
    """5 CPUs on a cluster of 4; or 3 nodes with a CPU each on a cluster of 2 such nodes."""
    config = load_service_config(model=model_dir("qwen3"), num_workers=workers, placement_strategy=strategy,
                                 name="too-big", placement_timeout_s=1.0)
    with pytest.raises(RuntimeError, match=rf"could not place {asked}; the cluster has \{{'CPU': 4.0\}}"):
        launch(config)
    assert "too-big" not in actor_nodes() and sorted(service.stats()) == [0, 1]


def test_removing_a_node_mid_stream_delivers_every_sample_exactly_once(cluster, service):
    """Runs last: it takes a node away. The lost worker's bundle is rescheduled on the remaining node."""
    cluster_, nodes = cluster
    placed = actor_nodes()
    victim = next(n for n in nodes if n.node_id != placed["rollout"])  # keep the service actor's node
    lost = next(w for w in (0, 1) if placed[f"rollout-worker-{w}"] == victim.node_id)
    prompts = random_prompts(8, 512, (4, 12), seed=12)
    batches = iter(rollout.sample(prompts, n=4, max_new_tokens=48, ignore_eos=True))
    received = [next(batches)]
    before = service.stats()
    assert before[lost]["outstanding"] > 0
    cluster_.remove_node(victim)
    received += list(batches)

    rows = [row for batch in received for row in batch.to_pylist()]
    assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == [(p, s) for p in range(8) for s in range(4)]
    assert all(len(r["token_ids"]) == 48 for r in rows)
    deadline = time.monotonic() + 90
    while sorted(stats := service.stats()) != [0, 1]:
        assert time.monotonic() < deadline, "the lost worker was not replaced"
        time.sleep(0.5)
    assert actor_nodes()[f"rollout-worker-{lost}"] != victim.node_id
    # the replacement took the current weights (version 1 after the update test) before any work
    assert stats[lost]["policy_version"] == before[lost]["policy_version"]
    again = rollout.sample(prompts[:4], n=2, max_new_tokens=4).to_table()
    assert again.num_rows == 8 and set(again.column("worker_id").to_pylist()) == {0, 1}

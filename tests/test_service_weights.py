"""Weight updates through the service (two CPU workers): every transport gives the outputs of a model holding
the new weights, the exact versions in rows for each mode, no reuse of KV cached before; refused weights
change nothing; a killed worker is replaced and serves the current version."""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import socket
import time

import pytest
import ray
import torch

import rollout
from rollout import weight_sync
from tests.conftest import hf_greedy, hf_model, random_prompts
from trainer_client import RolloutClient
from workers.weight_group import broadcast

PROMPT = random_prompts(1, 512, (40, 40), seed=70)[0]
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def policies(model_dir):
    """Two checkpoints of one architecture with different random weights."""
    return model_dir("qwen3"), model_dir("qwen3", seed=1)


@pytest.fixture(scope="module")
def client(policies):
    rollout.init(model=policies[0], num_workers=2, flush_rows=4, flush_delay_s=0.02, max_num_seqs=8,
                 num_blocks=256, object_store_memory_gib=0.5)
    yield RolloutClient.connect(name="rollout", namespace="rollout")
    rollout.shutdown()


@pytest.fixture(scope="module")
def states(policies):
    """The state dicts of both checkpoints, as a trainer would hold them."""
    return {path: hf_model(path).state_dict() for path in policies}


def versions(client: RolloutClient) -> set[int]:
    return {s["policy_version"] for s in client.stats().values()}


def set_weights(path: str) -> int:
    """Load the checkpoint `path` on every worker under a fresh version; returns the version."""
    version = next(_versions)
    rollout.update_weights(path, version)
    return version


def greedy(prompts: list[list[int]], new: int = 10, **sampling) -> list[dict]:
    table = rollout.sample(prompts, n=1, temperature=0.0, max_new_tokens=new, ignore_eos=True, **sampling)
    return table.to_table().to_pylist()


def start_long_sample(client: RolloutClient, new: int) -> rollout.RolloutStream:
    """A greedy sample of `new` tokens, returned once it has generated a few."""
    before = sum(s["decode_tokens"] for s in client.stats().values())
    stream = rollout.sample([PROMPT[:8]], n=1, temperature=0.0, max_new_tokens=new, ignore_eos=True,
                            return_token_versions=True)
    while sum(s["decode_tokens"] for s in client.stats().values()) < before + 3:
        time.sleep(0.005)
    return stream


def update_during_long_sample(client: RolloutClient, policies: tuple[str, str], states: dict, mode: str,
                              new_tokens: int) -> tuple[int, int, rollout.RolloutStream]:
    """Make the first policy current, start a greedy sample of `new_tokens`, then update to the second
    policy in `mode` while it runs; returns the old and new versions and the sample's stream."""
    old, new = policies
    v_old = set_weights(old)
    stream = start_long_sample(client, new_tokens)
    v_new = next(_versions)
    rollout.update_weights(states[new], v_new, mode=mode)
    return v_old, v_new, stream


@pytest.fixture(scope="module")
def sync(client):
    return rollout.init_weight_sync()


@pytest.mark.parametrize("transport", ["object_store", "checkpoint", "broadcast"])
def test_update_gives_the_new_model_and_recomputes_cached_prompts(client, policies, states, sync, transport):
    old, new = policies
    set_weights(old)
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(old, PROMPT)
    cached = sum(s["cached_prefix_tokens"] for s in client.stats().values())
    greedy([PROMPT])
    assert sum(s["cached_prefix_tokens"] for s in client.stats().values()) > cached, "the prompt is cached"
    cached = sum(s["cached_prefix_tokens"] for s in client.stats().values())

    version = next(_versions)
    rollout.update_weights(new if transport == "checkpoint" else states[new], version,
                           transport=None if transport == "object_store" else transport)
    assert versions(client) == {version}
    row = greedy([PROMPT])[0]
    assert row["token_ids"] == hf_greedy(new, PROMPT)
    assert row["policy_version"] == row["first_policy_version"] == version
    assert sum(s["cached_prefix_tokens"] for s in client.stats().values()) == cached, "old KV not reused"


def test_broadcasts_from_two_threads_go_one_after_another(client, policies, states, sync, monkeypatch):
    """Two threads push other weights over the one broadcast group at once, in many small buckets: their
    buckets used to interleave on the group, which crashed both workers."""
    monkeypatch.setattr(sync, "bucket_bytes", 64 * 2**10)
    pushes = {next(_versions): path for path in policies}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(rollout.update_weights, states[path], version, transport="broadcast")
                     for version, path in pushes.items()]:
            done.result(timeout=120)
    [version] = versions(client)
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(pushes[version], PROMPT)


def test_continue_mode_sample_spans_the_update(client, policies, states):
    old = policies[0]
    v_old, v_new, stream = update_during_long_sample(client, policies, states, "continue", 400)
    [row] = stream.to_table().to_pylist()
    switch = row["token_policy_versions"].index(v_new)
    assert 0 < switch < 400 and row["token_policy_versions"] == [v_old] * switch + [v_new] * (400 - switch)
    assert (row["first_policy_version"], row["policy_version"], row["finish_reason"]) == (v_old, v_new, "length")
    head = min(switch, 40)  # compared with transformers on a prefix: long greedy runs may split on near-ties
    assert row["token_ids"][:head] == hf_greedy(old, PROMPT[:8], head)


def test_abort_mode_ends_started_samples(client, policies, states):
    old = policies[0]
    v_old, v_new, stream = update_during_long_sample(client, policies, states, "abort", 400)
    [row] = stream.to_table().to_pylist()
    assert (row["finish_reason"], row["policy_version"], row["first_policy_version"]) == ("abort", v_old, v_old)
    assert 0 < len(row["token_ids"]) < 400
    head = min(len(row["token_ids"]), 40)
    assert row["token_ids"][:head] == hf_greedy(old, PROMPT[:8], head)
    assert greedy([PROMPT])[0]["policy_version"] == v_new


def test_finish_mode_drains_on_the_old_weights(client, policies, states):
    old, new = policies
    v_old, v_new, stream = update_during_long_sample(client, policies, states, "finish", 120)
    assert versions(client) == {v_new}
    [row] = stream.to_table().to_pylist()
    assert (row["finish_reason"], row["policy_version"], row["token_policy_versions"]) == (
        "length", v_old, [v_old] * 120)
    assert row["token_ids"][:40] == hf_greedy(old, PROMPT[:8], 40)
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(new, PROMPT)


@pytest.mark.parametrize("break_it, transport, match", [
    (lambda sd: sd.pop("lm_head.weight"), None, "missing 'lm_head.weight'"),
    (lambda sd: sd.update({"model.norm.weight": torch.zeros(3)}), None, r"'model.norm.weight' has shape \(3,\)"),
    (lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].bfloat16()}), None, "dtype torch.bfloat16"),
    (lambda sd: sd.pop("lm_head.weight"), "broadcast", "missing 'lm_head.weight'"),
], ids=["missing", "shape", "dtype", "broadcast-missing"])
def test_refused_state_dict_changes_nothing(client, policies, states, sync, break_it, transport, match, monkeypatch):
    """Refused tensors raise before anything is sent (no bucket of a broadcast), and every worker keeps its
    weights and version."""
    old, new = policies
    version = set_weights(old)
    state = dict(states[new])
    break_it(state)
    sent = []
    monkeypatch.setattr(weight_sync, "broadcast", lambda group, flat: (sent.append(flat.numel()),
                                                                       broadcast(group, flat)))
    with pytest.raises(ValueError, match=match):
        rollout.update_weights(state, version + 100, transport=transport)
    assert sent == []
    assert versions(client) == {version}
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(old, PROMPT)


def test_refused_checkpoint_and_bad_arguments_fail_at_the_call(client, policies, states, model_dir, tmp_path):
    version = set_weights(policies[0])
    with pytest.raises(ValueError, match="has shape"):
        rollout.update_weights(model_dir("qwen3", hidden_size=32), version + 100)
    for args, match in [((states[policies[1]], -1), "version=-1"), ((states[policies[1]], True), "version=True"),
                        ((policies[1], 2, "later"), "mode='later'"), ((str(tmp_path), 2), "not a directory of"),
                        ((42, 2), "non-empty state dict")]:
        with pytest.raises(ValueError, match=match):
            rollout.update_weights(*args)
    with pytest.raises(ValueError, match="transport='pigeon'"):
        rollout.update_weights(policies[1], 2, transport="pigeon")
    assert versions(client) == {version}


def test_killed_worker_is_replaced_with_the_current_weights(client, policies, states, sync):
    """The replay source of a broadcast update is a copy exported by worker 0; killing worker 0 itself
    shows that the copy outlives it. The update names its tensors as the base model does (no `model.`), which
    the engine maps to its own names: the copy is in the engine's names, and the replay must say so."""
    old, new = policies
    set_weights(old)
    version = next(_versions)
    rollout.update_weights({name.removeprefix("model."): t for name, t in states[new].items()}, version,
                           transport="broadcast")
    ray.kill(ray.get_actor("rollout-worker-0", namespace="rollout"), no_restart=True)
    deadline = time.monotonic() + 90
    while sorted(stats := client.stats()) != [0, 1]:
        assert time.monotonic() < deadline, "worker 0 was not replaced"
        time.sleep(0.2)
    assert stats[0]["policy_version"] == version and stats[0]["steps"] == 0, "a fresh engine, updated"
    prompts = [PROMPT, PROMPT[:20]]
    rows = greedy(prompts)
    assert {r["worker_id"] for r in rows} == {0, 1}
    assert [r["token_ids"] for r in rows] == [hf_greedy(new, p) for p in prompts]
    assert all(r["policy_version"] == version for r in rows)

    with pytest.raises(RuntimeError, match=r"the workers changed since init_weight_sync\(\) \(one was lost"):
        rollout.update_weights(states[old], version + 1, transport="broadcast")
    assert versions(client) == {version}
    rollout.init_weight_sync()
    rollout.update_weights(states[old], version + 1, transport="broadcast")
    assert versions(client) == {version + 1}
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(old, PROMPT)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError], ids=["ctrl-c", "trainer-error"])
def test_broadcast_stopped_part_way_changes_nothing(client, policies, states, monkeypatch, stop):
    """Ctrl-C (or an error) in the trainer before a broadcast's buckets are all sent: the workers waiting for
    them used to take the next update's buckets as the rest of this one, serving those weights under this
    version, while the next update waited `timeout_s` for buckets that never came."""
    old, new = policies
    rollout.init_weight_sync(timeout_s=20)
    version = set_weights(old)

    def stopped(*args):
        raise stop
    monkeypatch.setattr(rollout.weight_sync, "pack", stopped)
    with pytest.raises(stop) as err:
        rollout.update_weights(states[new], version + 1, transport="broadcast")
    assert "call init_weight_sync() again" in err.value.__notes__[0]
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"failed part way .*call init_weight_sync\(\) again"):
        rollout.update_weights(states[old], version + 2, transport="broadcast")
    assert versions(client) == {version}
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(old, PROMPT)

    rollout.init_weight_sync()
    rollout.update_weights(states[new], version + 3, transport="broadcast")
    assert versions(client) == {version + 3}
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(new, PROMPT)


def test_a_new_broadcast_group_closes_the_old_one(client, policies, states, monkeypatch):
    """`init_weight_sync` again (after a worker was replaced, say) closes the group it replaces, freeing its
    communicators (NCCL's hold GPU memory) rather than leaving them to the garbage collector; so does shutdown
    (tests/test_weight_group.py: the workers' side). One whose options are refused leaves it working."""
    aborted = []
    first = rollout.init_weight_sync()
    group = first.group
    monkeypatch.setattr(rollout.weight_sync, "close_group", aborted.append)
    second = rollout.init_weight_sync()
    assert aborted == [group] and first.group is None
    with pytest.raises(RuntimeError, match=r"closed \(by init_weight_sync\(\) or shutdown\); call init_weight_sync"):
        first.update_weights(states[policies[0]], next(_versions), mode="continue")
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA engines"):
        rollout.init_weight_sync(backend="nccl")  # refused: the group it would replace goes on
    for option, value in [("port", -1), ("port", "x"), ("timeout_s", 0), ("timeout_s", 1e14), ("host", "1.2.3.4")]:
        with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
            rollout.init_weight_sync(**{option: value})
    with socket.create_server(("127.0.0.1", 0)) as busy:  # another listener's port: refused before closing `second`
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port={port} cannot be listened on at 127.0.0.1"):
            rollout.init_weight_sync(host="127.0.0.1", port=port)
    assert second.group is not None and [g for g in aborted if g is not None] == [group]
    version = next(_versions)
    second.update_weights(states[policies[1]], version)
    assert versions(client) == {version}

    third = client.init_weight_sync()  # a RolloutClient's group too
    group = third.group
    client.init_weight_sync()
    assert aborted[-1] is group and third.group is None


def test_a_group_may_be_formed_again_on_its_own_port(client):
    """The port check of `init_weight_sync` spares the port of the group it replaces, free once that is closed."""
    first = rollout.init_weight_sync()
    assert rollout.init_weight_sync(port=first.spec.port).spec.port == first.spec.port


def test_a_broadcast_over_a_replaced_group_is_refused_at_once(client, policies, states):
    """Two groups formed in turn (here by `rollout` and a `RolloutClient` in one process; as well two
    trainers): the workers are in the newer one only, so a broadcast over the older waited `timeout_s` for
    buckets sent to a group nobody listened to. It is refused before anything is sent."""
    older = rollout.init_weight_sync(timeout_s=5)
    client.init_weight_sync(timeout_s=5)
    version = set_weights(policies[0])
    with pytest.raises(RuntimeError, match=r"replaced by a later init_weight_sync\(\)"):
        older.update_weights(states[policies[1]], version + 1)
    assert versions(client) == {version}
    client.update_weights(states[policies[1]], version + 1, transport="broadcast")  # over the client's group
    assert versions(client) == {version + 1}
    assert greedy([PROMPT])[0]["token_ids"] == hf_greedy(policies[1], PROMPT)

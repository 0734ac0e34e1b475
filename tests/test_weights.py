"""Policy weight hot-swap in the engine: validation, in-place copy, versions per mode, no stale KV."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rollout import SamplingParams
from tests.conftest import ctrl_c_at_step, hf_greedy, hf_model, make_engine, random_prompts, run
from workers.engine import weight_swap
from workers.engine.weights import check_weights, load_source
from workers.weight_format import checkpoint_tensors

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def policies(model_dir):
    """Two checkpoints of one architecture with different random weights."""
    return model_dir("qwen3"), model_dir("qwen3", seed=1)


@pytest.mark.parametrize("as_dir", [False, True], ids=["state_dict", "checkpoint_dir"])
def test_update_then_greedy_matches_new_model(policies, as_dir):
    old, new = policies
    prompt = random_prompts(1, 512, (40, 40), seed=50)[0]
    engine = make_engine(old)
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(old, prompt)
    cached_before = engine.stats()["cached_prefix_tokens"]
    params_before = engine.runner.model.model.embed_tokens.weight.data_ptr()
    engine.update_weights(new if as_dir else hf_model(new).state_dict(), version=1)
    assert engine.runner.model.model.embed_tokens.weight.data_ptr() == params_before, "copied in place"
    row = run(engine, [prompt], GREEDY)[(0, 0)]
    assert row["token_ids"] == hf_greedy(new, prompt)
    assert row["policy_version"] == row["first_policy_version"] == 1
    assert engine.stats()["cached_prefix_tokens"] == cached_before, "KV of the old weights is not reused"


def test_a_numpy_or_torch_integer_version_is_held_as_an_int(policies):
    """As `SamplingParams` takes them: a trainer's step counter is often one."""
    engine = make_engine(policies[0])
    for version in (np.int64(3), torch.tensor(4)):
        engine.update_weights(policies[1], version=version)
        assert type(engine.policy_version) is int and engine.policy_version == int(version)
    row = run(engine, [[5, 6, 7]], GREEDY)[(0, 0)]
    assert type(row["policy_version"]) is int and row["policy_version"] == 4


def test_a_version_number_that_comes_back_never_matches_kv_of_other_weights(policies):
    """A trainer that resumes or rolls back may push a version number again with other weights: the
    prompt's blocks cached under the first push are not reused by the second."""
    old, new = policies
    prompt = random_prompts(1, 512, (40, 40), seed=50)[0]
    engine = make_engine(old)
    for version, policy in [(1, new), (2, old), (1, old), (1, new)]:
        cached_before = engine.stats()["cached_prefix_tokens"]
        engine.update_weights(hf_model(policy).state_dict(), version=version)
        assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(policy, prompt), version
        assert engine.stats()["cached_prefix_tokens"] == cached_before, f"KV reused after version {version}"


def test_a_root_never_equals_a_one_token_block_of_older_weights(policies):
    """With block_size=1, the first update's root must not be the hash of the one-token block [1] cached
    before it, or `tail` would be served the old weights' KV of `[1] + tail`."""
    old, new = policies
    tail = list(range(20, 40))
    engine = make_engine(old, block_size=1)
    run(engine, [[1] + tail], GREEDY)
    engine.update_weights(hf_model(new).state_dict(), version=7)
    assert run(engine, [tail], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(new, tail)


def wrapped(state: dict) -> None:
    """The names of DDP's wrapper (`module.`) around the model."""
    for name in list(state):
        state["module." + name] = state.pop(name)


MIDDLE = "model.layers.1.self_attn.q_proj.weight"  # copy_ refuses a sparse source: the tensors before it were copied


@pytest.mark.parametrize("break_it, match", [
    (lambda sd: sd.pop("lm_head.weight"), "missing 'lm_head.weight'"),
    (lambda sd: sd.update(extra=torch.zeros(1)), "unexpected 'extra'"),
    (lambda sd: sd.update({"model.norm.weight": torch.zeros(3)}), r"'model.norm.weight' has shape \(3,\)"),
    (lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].half()}), "dtype torch.float16"),
    (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].to("meta")}), "'lm_head.weight' is a meta tensor"),
    (lambda sd: sd.update({MIDDLE: sd[MIDDLE].to_sparse()}), f"'{MIDDLE}' is a torch.sparse_coo tensor"),
    (wrapped, r"^weights refused, nothing was changed: the names carry 'module.', which a wrapper \(DDP"),
    (lambda sd: sd.update({"model.norm.weight": None}), "entry 'model.norm.weight' is a NoneType, not a tensor"),
    (lambda sd: sd.update({"model.norm.weight": "ones"}), "entry 'model.norm.weight' is a str, not a tensor"),
    (lambda sd: sd.update({7: torch.zeros(1)}), "state dict key 7 is a int, not a str"),
], ids=["missing", "unexpected", "shape", "dtype", "meta", "sparse-midway", "wrapper-prefix", "none", "str", "key"])
def test_bad_state_dict_refused_and_nothing_changes(policies, break_it, match):
    old, new = policies
    prompt = random_prompts(1, 512, (12, 12), seed=51)[0]
    engine = make_engine(old)
    state = dict(hf_model(new).state_dict())
    break_it(state)
    with pytest.raises(ValueError, match=match):
        engine.update_weights(state, version=1)
    assert engine.policy_version == 0
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(old, prompt)


def test_numpy_arrays_are_taken_with_negative_strides_too(policies):
    """torch cannot view np.flip's arrays: its own error escaped, naming no weight."""
    old, new = policies
    state = {name: tensor.numpy() for name, tensor in hf_model(new).state_dict().items()}
    state["model.norm.weight"] = np.ascontiguousarray(state["model.norm.weight"][::-1])[::-1]
    engine = make_engine(old)
    engine.update_weights(state, version=1)
    prompt = random_prompts(1, 512, (12, 12), seed=52)[0]
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(new, prompt)


def test_tied_embeddings_update_from_a_checkpoint(model_dir):
    """Checkpoints of models with tied embeddings leave out `lm_head.weight`: the update goes through
    the embedding it shares; with neither name given, both are reported missing."""
    old, new = (model_dir("qwen2", tie_word_embeddings=True, seed=seed) for seed in (0, 1))
    assert "lm_head.weight" not in load_source(new)
    prompt = random_prompts(1, 512, (12, 12), seed=52)[0]
    engine = make_engine(old)
    engine.update_weights(new, version=1)
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(new, prompt)
    state = {k: v for k, v in load_source(old).items() if k != "model.embed_tokens.weight"}
    with pytest.raises(ValueError, match="missing 'model.embed_tokens.weight'; missing 'lm_head.weight'"):
        engine.update_weights(state, version=2)
    both = {**load_source(old), "lm_head.weight": load_source(old)["model.embed_tokens.weight"].clone()}
    both["lm_head.weight"][0, 0] = both["model.embed_tokens.weight"][0, 0] = float("nan")
    engine.update_weights(both, version=2)  # the tied pair given twice with one value (NaN included): fine
    engine.update_weights(hf_model(old).state_dict(), version=2)  # given as one tensor under both names
    assert "lm_head.weight" in hf_model(old).state_dict()
    both["lm_head.weight"] = both["lm_head.weight"] + 1  # a trainer's untied copy: one value would win
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' are one tied tensor"):
        engine.update_weights(both, version=3)
    assert engine.policy_version == 2
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(old, prompt)


def test_bad_mode_and_source(policies, tmp_path):
    engine = make_engine(policies[0])
    with pytest.raises(ValueError, match="mode='later'"):
        engine.update_weights(policies[1], version=1, mode="later")
    with pytest.raises(ValueError, match="is not a directory of \\*.safetensors files"):
        engine.update_weights(str(tmp_path), version=1)
    shutil.copytree(policies[1], tmp_path / "new")
    save_file({"model.norm.weight": torch.ones(32) * 7}, tmp_path / "new" / "stale.safetensors")
    with pytest.raises(ValueError, match="holds 'model.norm.weight' twice, in model.safetensors and stale"):
        engine.update_weights(str(tmp_path / "new"), version=1)
    assert engine.policy_version == 0


def test_a_truncated_shard_is_refused_by_name(policies, tmp_path):
    """A shard cut short (a copy still being written) failed with safetensors' own error, naming no file."""
    engine = make_engine(policies[0])
    shutil.copytree(policies[1], tmp_path / "new")
    shard = tmp_path / "new" / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    for refuse in (checkpoint_tensors, lambda path: engine.update_weights(path, version=1)):
        with pytest.raises(ValueError, match=f"checkpoint file '{shard}' cannot be read"):
            refuse(str(tmp_path / "new"))
    assert engine.policy_version == 0


def start(engine, prompts, params, steps: int) -> dict:
    """Add every prompt, run `steps` steps; returns rows finished so far."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, prompt_index=i)
    rows = {}
    for _ in range(steps):
        rows.update(((r["prompt_index"], r["sample_index"]), r) for r in engine.step())
        engine.check_integrity()
    return rows


def finish(engine, rows: dict) -> dict:
    while engine.has_unfinished():
        rows.update(((r["prompt_index"], r["sample_index"]), r) for r in engine.step())
        engine.check_integrity()
    return rows


def test_mode_continue_spans_versions(policies):
    old, new = policies
    engine = make_engine(old)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True, return_token_versions=True)
    prompt = random_prompts(1, 512, (8, 8), seed=52)[0]
    rows = start(engine, [prompt], params, steps=4)
    assert engine.update_weights(new, version=7, mode="continue") == []
    rows = finish(engine, rows)
    for row in rows.values():
        assert row["token_policy_versions"] == [0] * 4 + [7] * 6
        assert (row["first_policy_version"], row["policy_version"]) == (0, 7)
        assert row["token_ids"][:4] == hf_greedy(old, prompt)[:4]


def one_group_started(path: str, seed: int) -> tuple:
    """Two greedy n=2 prompts where only the first fits (max_num_seqs=2), after 3 steps."""
    engine = make_engine(path, max_num_seqs=2)
    prompts = random_prompts(2, 512, (8, 8), seed=seed)
    rows = start(engine, prompts, SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True), steps=3)
    return engine, prompts, rows


def test_mode_abort_ends_started_samples_and_keeps_queued_ones(policies):
    old, new = policies
    engine, prompts, rows = one_group_started(old, seed=53)
    aborted = engine.update_weights(new, version=2, mode="abort")
    engine.check_integrity()
    assert sorted(r["sample_index"] for r in aborted) == [0, 1]
    assert all(r["finish_reason"] == "abort" and r["policy_version"] == 0 and len(r["token_ids"]) == 3
               for r in aborted)
    rest = finish(engine, rows)
    assert [rest[(1, s)]["token_ids"] for s in range(2)] == [hf_greedy(new, prompts[1])] * 2
    assert all(rest[(1, s)]["policy_version"] == 2 for s in range(2))


def test_mode_finish_drains_on_old_weights(policies):
    old, new = policies
    engine, prompts, rows = one_group_started(old, seed=54)
    drained = engine.update_weights(new, version=3, mode="finish")
    assert sorted(r["sample_index"] for r in drained) == [0, 1]
    assert all(r["finish_reason"] == "length" and r["policy_version"] == 0 for r in drained)
    assert all(r["token_ids"] == hf_greedy(old, prompts[0]) for r in drained)
    rest = finish(engine, rows)
    assert all(rest[(1, s)]["token_ids"] == hf_greedy(new, prompts[1]) for s in range(2))
    assert all(rest[(1, s)]["policy_version"] == 3 for s in range(2))


def test_a_finish_drain_stopped_by_ctrl_c_loses_no_row(policies):
    """Ctrl-C during a "finish" drain: the samples that ended in it come back from the next step; the
    weights stay the old ones and the rest of the samples finish on them."""
    old, new = policies
    engine = make_engine(old, max_num_seqs=4)
    prompts = random_prompts(2, 512, (8, 8), seed=55)
    for i, steps in enumerate([5, 9]):
        engine.add_request(prompts[i], SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True),
                           prompt_index=i)
    rows = {}
    for _ in range(3):
        rows.update(((r["prompt_index"], r["sample_index"]), r) for r in engine.step())
    with ctrl_c_at_step(engine, 4):
        engine.update_weights(new, version=1, mode="finish")
    rows = finish(engine, rows)
    assert sorted(rows) == [(0, 0), (1, 0)] and engine.policy_version == 0
    assert [rows[(i, 0)]["token_ids"] for i in range(2)] == [hf_greedy(old, p, n) for p, n in zip(prompts, [5, 9])]


def test_weights_copied_through_a_ctrl_c_are_all_copied(policies, monkeypatch):
    """A Ctrl-C between the copies of an update is raised once every tensor is in, labelled the new version."""
    old, new = policies
    engine = make_engine(old)
    pairs = check_weights(engine.runner.model, load_source(new))
    dst = pairs[len(pairs) // 2][0]
    copy, calls = dst.copy_, []

    def interrupted_copy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return copy(*args, **kwargs)

    dst.copy_ = interrupted_copy
    monkeypatch.setattr(weight_swap, "check_weights", lambda model, source, checkpoint: pairs)
    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(new, version=4)
    assert engine.policy_version == 4
    prompt = random_prompts(1, 512, (8, 8), seed=56)[0]
    assert run(engine, [prompt], GREEDY)[(0, 0)]["token_ids"] == hf_greedy(new, prompt)


@pytest.mark.parametrize("mode", ["continue", "abort", "finish"])
def test_a_prompt_in_prefill_when_an_update_lands_runs_on_the_new_weights(policies, mode):
    """A prompt prefilled in 16-token chunks has sampled nothing after one step: whatever the mode, it is
    computed again under the new weights, like a queued one, so its rows' versions tell the truth (its old
    chunks' KV used to stay under a row saying every token was the new version's)."""
    old, new = policies
    engine = make_engine(old, max_batch_tokens=16)
    prompt = random_prompts(1, 512, (40, 40), seed=55)[0]
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True, return_token_versions=True)
    rows = start(engine, [prompt], params, steps=1)
    assert engine.update_weights(new, version=4, mode=mode) == []
    rows = finish(engine, rows)
    for s in range(2):
        assert rows[(0, s)]["token_ids"] == hf_greedy(new, prompt)
        assert rows[(0, s)]["token_policy_versions"] == [4] * 10


def test_a_sample_recomputing_its_context_when_an_update_lands_recomputes_it_all_on_the_new_weights(policies):
    """A sample preempted for recompute (no CPU pool) is part way through its context, in 8-token chunks, when
    a "continue" update lands: its context is computed again, all of it under the new weights, so its later
    tokens' logprobs are the new model's over it (half old and half new KV gave errors of several nats)."""
    old, new = policies
    engine = make_engine(old, block_size=4, num_blocks=14, max_batch_tokens=8, cpu_offload_gib=0)
    prompts = random_prompts(3, 512, (10, 10), seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, return_token_versions=True)
    rows = start(engine, prompts, params, steps=0)
    while not any(s.started and s.num_uncomputed > 1 for s in engine.scheduler.running):
        rows.update(start(engine, [], params, steps=1))
    engine.update_weights(new, version=1)
    rows = finish(engine, rows)
    model = hf_model(new)
    spanning = [r for r in rows.values() if r["num_preemptions"] and 1 in r["token_policy_versions"]]
    assert spanning
    for row in spanning:
        start_at, first_new = len(prompts[row["prompt_index"]]), row["token_policy_versions"].index(1)
        ids = prompts[row["prompt_index"]] + row["token_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        want = [logprobs[t - 1, ids[t]].item() for t in range(start_at + first_new, len(ids))]
        assert row["logprobs"][first_new:] == pytest.approx(want, abs=1e-4)

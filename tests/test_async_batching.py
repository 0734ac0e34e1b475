"""Async batching: step t+1 is scheduled and launched before step t is collected, its placeholder tokens
filled on the device. Samples equal async off; a stop token found late wastes one token, never emitted."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from rollout.config import EngineConfig
from tests.conftest import DEVICES, assert_nothing_leaked, gib_per_block, make_engine, random_prompts, run
from tests.test_preemption import BLOCK

STOP = [344, 35, 157]  # tokens the tiny qwen3 often samples: many samples stop on one, at different steps


@pytest.fixture(scope="module")
def workload(model_dir):
    """Prompts sharing a system prompt, and greedy and sampled params with n > 1, stop tokens and lengths."""
    system = random_prompts(1, 512, (20, 20), seed=40)[0]
    prompts = [system + q for q in random_prompts(8, 512, (3, 20), seed=41)]
    kinds = [SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=STOP[:1]),
             SamplingParams(n=4, temperature=1.0, max_new_tokens=30, seed=1, stop_token_ids=STOP),
             SamplingParams(n=3, temperature=0, max_new_tokens=12, ignore_eos=True),
             SamplingParams(n=2, temperature=0.8, top_p=0.9, min_p=0.05, max_new_tokens=1, seed=2)]
    return model_dir("qwen3"), prompts, [kinds[i % 4] for i in range(8)]


def without_stops(params: list[SamplingParams]) -> list[SamplingParams]:
    return [SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
                           max_new_tokens=p.max_new_tokens, ignore_eos=True) for p in params]


def generate(path: str, prompts, params, async_batching: bool, **config) -> tuple[dict, dict]:
    """Rows by (prompt, sample) and the stats, integrity checked inside and after every step; at most 12
    samples run at once, so later prompts find the system prompt's blocks cached."""
    engine = make_engine(path, async_batching=async_batching, check_integrity=True, block_size=BLOCK,
                         max_batch_tokens=64, max_num_seqs=12, **config)
    return run(engine, prompts, params), engine.stats()


def assert_same_samples(rows: dict, want: dict, abs_tol: float | None) -> None:
    """Same tokens, finish reasons and versions; logprobs equal (within `abs_tol` when given: a wasted
    row changes the step's matmul shapes, and with them the float rounding)."""
    assert rows.keys() == want.keys()
    for key, row in rows.items():
        for name in ("token_ids", "finish_reason", "policy_version", "first_policy_version"):
            assert row[name] == want[key][name], f"sample {key}: {name}"
        expected = want[key]["logprobs"] if abs_tol is None else pytest.approx(want[key]["logprobs"], abs=abs_tol)
        assert row["logprobs"] == expected, f"sample {key}"


@pytest.mark.parametrize("device", DEVICES)
def test_same_samples_and_counters_as_async_off(workload, device):
    path, prompts, params = workload
    off, off_stats = generate(path, prompts, params, False, device=device, num_blocks=512)
    on, on_stats = generate(path, prompts, params, True, device=device, num_blocks=512)
    assert_same_samples(on, off, abs_tol=1e-5 if device == "cpu" else 1e-4)
    reasons = [row["finish_reason"] for row in off.values()]
    assert "stop" in reasons and "length" in reasons
    assert off_stats["cached_prefix_tokens"] > 0 and off_stats["forks"] > 0
    assert on_stats["wasted_tokens"] > 0 == off_stats["wasted_tokens"]
    assert on_stats["steps"] >= off_stats["steps"]
    same = {k: v for k, v in off_stats.items() if k not in ("steps", "wasted_tokens")}
    assert {k: on_stats[k] for k in same} == same


@pytest.mark.parametrize("cpu_blocks", [0, 4096, 6], ids=["recompute", "offload", "both"])
def test_same_samples_under_memory_pressure(workload, cpu_blocks):
    """With stop tokens a stopped sample holds its blocks one step longer (unless the next step preempts: the
    step in flight is collected first), so admissions, and with them preemptions and the counters, may
    differ, but never the samples; without stop tokens every decision, counter and logprob is the same."""
    path, prompts, params = workload
    tight = dict(num_blocks=14, cpu_offload_gib=cpu_blocks * gib_per_block(path, BLOCK))
    off, off_stats = generate(path, prompts, params, False, **tight)
    on, on_stats = generate(path, prompts, params, True, **tight)
    assert_same_samples(on, off, abs_tol=1e-5)
    for stats in (off_stats, on_stats):
        assert stats["recomputes"] + stats["offloads"] > 0 and (stats["offloads"] > 0) == (cpu_blocks > 0)
    off, off_stats = generate(path, prompts, without_stops(params), False, **tight)
    on, on_stats = generate(path, prompts, without_stops(params), True, **tight)
    assert_same_samples(on, off, abs_tol=None)
    assert on_stats == off_stats


def test_a_sample_stopped_in_the_step_in_flight_is_not_preempted(model_dir):
    """Two greedy samples of 2-token blocks in 7 blocks; B's 4th token is its stop token, and B's next decode
    would start a block that is not there. With async batching the step that needs it is scheduled while B's
    stop token is still in flight: the engine collects that step before preempting, so B ends with its stop
    and is never offloaded, as with async off."""
    path = model_dir("qwen3")
    prompts = [[11, 12, 13], [21, 22, 23]]
    free = run(make_engine(path), prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    stop = free[(1, 0)]["token_ids"][3]
    assert stop not in free[(1, 0)]["token_ids"][:3]
    params = [SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop])]
    results = []
    for async_batching in (False, True):
        engine = make_engine(path, block_size=2, num_blocks=7, max_batch_tokens=64, async_batching=async_batching,
                             cpu_offload_gib=64 * gib_per_block(path, 2), check_integrity=True)
        rows = run(engine, prompts, params)
        results.append((rows[(1, 0)]["finish_reason"], rows[(1, 0)]["num_preemptions"], engine.stats()["offloads"]))
    assert results[0] == results[1] == ("stop", 0, 0)


def test_a_stop_found_late_wastes_one_token_never_emitted(workload):
    path = workload[0]
    prompt = random_prompts(1, 512, (12, 12), seed=42)[0]
    free = run(make_engine(path), [prompt], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    tokens = free[(0, 0)]["token_ids"]
    first = tokens.index(tokens[5])
    engine = make_engine(path, async_batching=True, check_integrity=True)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, stop_token_ids=[tokens[5]])
    row = run(engine, [prompt], params)[(0, 0)]
    assert row["finish_reason"] == "stop" and row["token_ids"] == tokens[:first + 1]
    assert row["logprobs"] == free[(0, 0)]["logprobs"][:first + 1]
    stats = engine.stats()
    # the prefill samples token 0; decodes compute tokens 0..first-1; the stop token's decode is wasted
    assert (stats["decode_tokens"], stats["wasted_tokens"], stats["steps"]) == (first, 1, first + 2)


def test_abort_with_a_step_in_flight_matches_async_off(workload):
    """Aborted samples hold the in-flight step's token; samples the in-flight step finished are not lost
    (their rows come from the next step)."""
    path = workload[0]
    prompts = random_prompts(2, 512, (20, 20), seed=43)
    out = {}
    for async_batching in (False, True):
        engine = make_engine(path, async_batching=async_batching, check_integrity=True)
        long = engine.add_request(prompts[0], SamplingParams(n=3, max_new_tokens=50, seed=3, ignore_eos=True))
        short = engine.add_request(prompts[1], SamplingParams(n=2, max_new_tokens=3, seed=4, ignore_eos=True))
        rows = [row for _ in range(3) for row in engine.step()]
        assert (engine.in_flight is not None) == async_batching
        rows += engine.abort(long) + engine.abort(short)
        while engine.has_unfinished():
            rows += engine.step()
        engine.check_integrity()
        assert_nothing_leaked(engine)
        out[async_batching] = sorted((r["request_id"].split("/")[0] == long, r["sample_index"], r["token_ids"],
                                      r["logprobs"], r["finish_reason"]) for r in rows)
    assert out[True] == out[False]
    assert [(r[0], len(r[2]), r[4]) for r in out[True]] == [(False, 3, "length")] * 2 + [(True, 3, "abort")] * 3


@pytest.mark.parametrize("mode", ["continue", "abort", "finish"])
def test_update_weights_with_a_step_in_flight_matches_async_off(model_dir, mode):
    """The in-flight step's tokens are the old version's; every row and version equals async off."""
    old, new = model_dir("qwen3"), model_dir("qwen3", seed=1)
    prompts = random_prompts(2, 512, (8, 8), seed=44)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10, ignore_eos=True, return_token_versions=True)
    out = {}
    for async_batching in (False, True):
        engine = make_engine(old, async_batching=async_batching, check_integrity=True, max_num_seqs=2)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, prompt_index=i)
        rows = [row for _ in range(3) for row in engine.step()]
        assert (engine.in_flight is not None) == async_batching
        rows += engine.update_weights(new, version=5, mode=mode)
        while engine.has_unfinished():
            rows += engine.step()
        assert_nothing_leaked(engine)
        out[async_batching] = sorted((r["prompt_index"], r["sample_index"], r["token_ids"], r["logprobs"],
                                      r["finish_reason"], r["token_policy_versions"]) for r in rows)
    assert out[True] == out[False]
    first = {"continue": [0] * 3 + [5] * 7, "abort": [0] * 3, "finish": [0] * 10}[mode]
    assert [r[5] for r in out[True]] == [first] * 2 + [[5] * 10] * 2


def test_async_batching_resolves_to_off_on_the_cpu(model_dir):
    assert make_engine(model_dir("qwen3")).async_batching is False
    with pytest.raises(ValueError, match=r"async_batching=.yes. is not of type bool \| None"):
        EngineConfig(model=model_dir("qwen3"), async_batching="yes")

"""Requests at the edges of what an engine holds: one that it accepts completes exactly, however tight the
cache; one that it refuses names the limit it is past."""

from __future__ import annotations

import random

import pytest

from rollout import SamplingParams
from tests.conftest import gib_per_block, hf_greedy, make_engine, run


@pytest.mark.parametrize("name, block_size, max_model_len, windowed_kv", [
    ("llama", 1, 2, "auto"), ("qwen3_5_text", 3, 4, "auto"), ("gpt_oss", 1, 3, "window")])
def test_an_engine_smaller_than_the_warm_up_step_serves_what_fits(zoo_dir, name, block_size, max_model_len,
                                                                  windowed_kv):
    """A cache of fewer tokens than the start-up warm-up step (2; 4 with per-sequence state), or a max_model_len
    shorter than it with rings, starts, and serves a request that fills both exactly (the warm-up wrote past the
    cache, or past the rings' table: an error at start)."""
    path = zoo_dir(name)
    engine = make_engine(path, block_size=block_size, num_blocks=-(-(max_model_len - 1) // block_size),
                         max_model_len=max_model_len, windowed_kv=windowed_kv)
    prompt = [5, 9, 17][:max_model_len - 1]
    rows = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert rows[0, 0]["token_ids"] == hf_greedy(path, prompt, 1)
    assert rows[0, 0]["finish_reason"] == "length"


def test_an_automatic_cache_of_one_longest_sequence_is_enough(model_dir):
    """A budget of one block serves max_model_len=17 with blocks of 16: the last token is sampled, never stored
    (it was refused as fewer than the 2 blocks one sequence needs)."""
    path = model_dir()
    engine = make_engine(path, num_blocks=None, kv_cache_memory_gib=1.5 * gib_per_block(path, 16), max_model_len=17)
    assert engine.pool.num_blocks == 1
    prompt = list(range(5, 21))
    rows = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert rows[0, 0]["token_ids"] == hf_greedy(path, prompt, 1)


@pytest.mark.parametrize("prefix_caching, cpu_blocks, max_batch_tokens", [
    (True, 0, 1), (False, 0, 5), (True, 3, 256), (False, 30, 2)])
def test_requests_that_each_need_the_whole_cache_complete_together(model_dir, prefix_caching, cpu_blocks,
                                                                   max_batch_tokens):
    """Three requests that each need exactly the cache's 8 blocks of 3 (a prompt of max_model_len - 1 tokens; n=3
    samples reaching max_model_len exactly; n=max_num_seqs, forked with a partial last block) are accepted, and
    together, preempting one another, give a roomy engine's greedy tokens; one block less refuses each."""
    path = model_dir()
    greedy = dict(temperature=0, ignore_eos=True)
    prompts = [list(range(5, 28)), list(range(40, 50)), [7, 8, 9, 10, 11]]
    params = [SamplingParams(max_new_tokens=5, **greedy), SamplingParams(n=3, max_new_tokens=14, **greedy),
              SamplingParams(n=4, max_new_tokens=30, **greedy)]
    config = dict(block_size=3, max_model_len=24, max_num_seqs=4)
    for prompt, p in zip(prompts, params):
        with pytest.raises(ValueError, match=r"needs 8 blocks of 3 tokens; the cache has 7 \(num_blocks=7\)"):
            make_engine(path, num_blocks=7, **config).tokenize([prompt], p)
    want = run(make_engine(path, **config), prompts, params)
    engine = make_engine(path, num_blocks=8, enable_prefix_caching=prefix_caching, max_batch_tokens=max_batch_tokens,
                         cpu_offload_gib=cpu_blocks * gib_per_block(path, 3), **config)
    got = run(engine, prompts, params)
    assert {k: list(r["token_ids"]) for k, r in got.items()} == {k: list(r["token_ids"]) for k, r in want.items()}
    assert [len(got[i, 0]["token_ids"]) for i in range(3)] == [1, 14, 19]
    assert engine.stats()["recomputes"] + engine.stats()["offloads"] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_restores_stay_within_max_batch_tokens(model_dir, seed):
    """With max_batch_tokens below max_num_seqs, the samples restored from the CPU pool in one step never take it
    past max_batch_tokens (the rest wait a step: restored past it, a step made 3 tokens, or failed), and the
    seeded samples are a roomy engine's."""
    path, rng = model_dir(), random.Random(seed)
    prompts, params = [], []
    for _ in range(3):
        prompts.append([rng.randrange(5, 100) for _ in range(rng.randrange(3, 8))])
        params.append(SamplingParams(n=rng.choice([2, 4]), max_new_tokens=rng.randrange(8, 16), ignore_eos=True,
                                     seed=seed))
    config = dict(block_size=4, max_model_len=24, max_num_seqs=8)
    want = run(make_engine(path, **config), prompts, params)
    engine = make_engine(path, num_blocks=8, max_batch_tokens=2, cpu_offload_gib=4 * gib_per_block(path, 4), **config)
    schedule, step_tokens = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: step_tokens.append(sum((batch := schedule()).num_tokens)) or batch
    got = run(engine, prompts, params)
    assert {k: list(r["token_ids"]) for k, r in got.items()} == {k: list(r["token_ids"]) for k, r in want.items()}
    assert max(step_tokens) == 2 and engine.stats()["restores"] > 0

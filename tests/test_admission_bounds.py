"""Requests at the edges of what an engine holds: one that it accepts completes exactly, however tight the
cache; one that it refuses names the limit it is past."""

from __future__ import annotations

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

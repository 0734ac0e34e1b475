"""Requests at the edges of what an engine holds: one that it accepts completes exactly, however tight the
cache; one that it refuses names the limit it is past."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from tests.conftest import hf_greedy, make_engine, run


@pytest.mark.parametrize("name, block_size", [("llama", 1), ("qwen3_5_text", 3)])
def test_a_cache_smaller_than_the_warm_up_step_serves_what_fits(zoo_dir, name, block_size):
    """A one-block cache of fewer tokens than the start-up warm-up step (2; 4 with recurrent state) starts, and
    serves a request that needs that block exactly (the warm-up wrote past the cache: IndexError at start)."""
    path = zoo_dir(name)
    engine = make_engine(path, block_size=block_size, num_blocks=1, max_model_len=block_size + 1)
    prompt = [5, 9, 17][:block_size]
    rows = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert rows[0, 0]["token_ids"] == hf_greedy(path, prompt, 1)
    assert rows[0, 0]["finish_reason"] == "length"

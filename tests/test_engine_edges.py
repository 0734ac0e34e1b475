"""Engine edge cases found by mutation testing: behaviour at exact block boundaries, counters and the
bookkeeping of preempted, forked and aborted samples, each pinned through the public Engine API."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from tests.conftest import make_engine, random_prompts, run

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(model_dir):
    return model_dir("qwen3")


@pytest.mark.parametrize("length", [16, 32])
def test_a_block_completed_by_the_last_prefill_step_is_cached(qwen3, length):
    """A prompt of whole blocks that ends at its first sampled token completes its last block in its last
    step: every block is cached, so a longer prompt starting with it is served all of them."""
    prompt = random_prompts(1, 512, (length, length), seed=20)[0]
    engine = make_engine(qwen3, block_size=16)
    run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
    run(engine, [prompt + [7, 8, 9]], GREEDY)
    assert engine.stats()["cached_prefix_tokens"] == length

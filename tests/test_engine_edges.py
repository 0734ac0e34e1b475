"""Engine edge cases found by mutation testing: behaviour at exact block boundaries, counters and the
bookkeeping of preempted, forked and aborted samples, each pinned through the public Engine API."""

from __future__ import annotations

import pytest

from rollout import SamplingParams
from tests.conftest import assert_nothing_leaked, make_engine, random_prompts, run

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


def test_the_newest_request_is_preempted_and_every_sample_forked_after_reports_it(qwen3):
    """Blocks run short while a 2-sample prompt, admitted after a long decode, is still in prefill: the newest
    request (the prompt) is preempted and recomputed, never the older decode, and both samples forked from the
    prompt afterwards report that preemption; tokens are those of a roomy engine."""
    short, long = random_prompts(1, 512, (4, 4), seed=3)[0], random_prompts(1, 512, (24, 24), seed=4)[0]
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_new_tokens=2, ignore_eos=True)]
    tight = make_engine(qwen3, block_size=4, num_blocks=8, max_batch_tokens=4, cpu_offload_gib=0)
    rows = run(tight, [short, long], params)
    assert tight.stats()["recomputes"] > 0
    assert rows[(0, 0)]["num_preemptions"] == 0
    assert rows[(1, 0)]["num_preemptions"] == rows[(1, 1)]["num_preemptions"] == 1
    roomy = run(make_engine(qwen3, block_size=4), [short, long], params)
    assert {k: r["token_ids"] for k, r in rows.items()} == {k: r["token_ids"] for k, r in roomy.items()}


@pytest.mark.parametrize("n", [1, 3])
def test_a_launch_that_fails_after_a_prompts_last_chunk_was_scheduled_leaks_no_block(qwen3, monkeypatch, n):
    """Ctrl-C (or a device error) in the launch of a step that scheduled a prompt's last chunk, with the copies
    of its partial last block reserved for its fork: `generate` aborts it and every block, reserved ones too,
    is back; the next call runs normally."""
    engine = make_engine(qwen3, block_size=16)
    prompt = random_prompts(1, 512, (20, 20), seed=21)[0]
    launch = engine.runner.launch

    def failing(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "launch", failing)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([prompt], SamplingParams(n=n, temperature=0, max_new_tokens=4, ignore_eos=True))
    engine.check_integrity()
    assert_nothing_leaked(engine)
    monkeypatch.setattr(engine.runner, "launch", launch)
    assert len(run(engine, [prompt], SamplingParams(n=n, temperature=0, max_new_tokens=4, ignore_eos=True))) == n


def test_a_finished_sample_gives_its_tail_blocks_to_eviction_first(qwen3):
    """A finished sample's cached blocks are evicted from its last block back to its first, so a cache short of
    room keeps the start of a prompt (a prefix is matched from its first block: losing that loses it all)."""
    prompt, other = random_prompts(1, 512, (12, 12), seed=22)[0], random_prompts(1, 512, (20, 20), seed=23)[0]
    engine = make_engine(qwen3, block_size=4, num_blocks=8)
    run(engine, [prompt], GREEDY)
    run(engine, [other], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    cached = engine.stats()["cached_prefix_tokens"]
    run(engine, [prompt], GREEDY)
    assert engine.stats()["cached_prefix_tokens"] - cached == 8


@pytest.mark.parametrize("max_batch_tokens, num_blocks", [(4, 8), (8, 7)])
def test_a_running_prompt_short_of_its_fork_blocks_waits_for_them(qwen3, max_batch_tokens, num_blocks):
    """A 3-sample prompt in chunked prefill beside a growing decode finds blocks for its last tokens but not for
    the copies of its partial last block its fork needs: its chunk stops short of its last token until they can
    be had, so no child writes a block it shares; every sample equals a roomy engine's."""
    short, long = random_prompts(1, 512, (4, 4), seed=3)[0], random_prompts(1, 512, (18, 18), seed=4)[0]
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=0, max_new_tokens=3, ignore_eos=True)]
    engine = make_engine(qwen3, block_size=4, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                         cpu_offload_gib=0)
    rows = run(engine, [short, long], params)
    roomy = run(make_engine(qwen3, block_size=4), [short, long], params)
    assert {k: r["token_ids"] for k, r in rows.items()} == {k: r["token_ids"] for k, r in roomy.items()}

"""Engine edge cases found by mutation testing: behaviour at exact block boundaries, counters and the
bookkeeping of preempted, forked and aborted samples, each pinned through the public Engine API."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from tests.conftest import assert_nothing_leaked, ctrl_c_at_step, gib_per_block, make_engine, random_prompts, run
from workers.engine.batch import Batch
from workers.engine.block_pool import prompt_hash
from workers.engine.sampler import filtered_logits, inverse_cdf, sample_key, sampling_arrays, sampling_batch, uniforms
from workers.engine.staging import Staging

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
    prompt afterwards report that preemption; its computed-again tokens are counted as recomputed; tokens are
    those of a roomy engine."""
    short, long = random_prompts(1, 512, (4, 4), seed=3)[0], random_prompts(1, 512, (24, 24), seed=4)[0]
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_new_tokens=2, ignore_eos=True)]
    tight = make_engine(qwen3, block_size=4, num_blocks=8, max_batch_tokens=4, cpu_offload_gib=0)
    rows = run(tight, [short, long], params)
    stats = tight.stats()
    assert stats["recomputes"] > 0 and stats["recomputed_tokens"] > 0, "a context computed again counts apart"
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


@pytest.mark.parametrize("max_batch_tokens, num_blocks, cpu_blocks", [(4, 8, 0), (8, 7, 0), (4, 8, 16)])
def test_a_running_prompt_short_of_its_fork_blocks_waits_for_them(qwen3, max_batch_tokens, num_blocks, cpu_blocks):
    """A 3-sample prompt in chunked prefill beside a growing decode finds blocks for its last tokens but not for
    the copies of its partial last block its fork needs: its chunk stops short of its last token until they can
    be had, so no child writes a block it shares; every sample equals a roomy engine's. Preempted with its one
    token left, it is recomputed even with room in the CPU pool: restored, it would decode that token as a
    sample and fork without those copies."""
    short, long = random_prompts(1, 512, (4, 4), seed=3)[0], random_prompts(1, 512, (18, 18), seed=4)[0]
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=0, max_new_tokens=3, ignore_eos=True)]
    engine = make_engine(qwen3, block_size=4, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                         cpu_offload_gib=cpu_blocks * gib_per_block(qwen3, 4))
    rows = run(engine, [short, long], params)
    roomy = run(make_engine(qwen3, block_size=4), [short, long], params)
    assert {k: r["token_ids"] for k, r in rows.items()} == {k: r["token_ids"] for k, r in roomy.items()}
    assert engine.stats()["offloads"] == 0


def test_a_preempted_request_waits_first_in_line(qwen3):
    """Request 1, preempted for recompute while request 2 still waits for a place, is readmitted before it, so
    it is preempted once and finishes before request 2."""
    engine = make_engine(qwen3, block_size=4, num_blocks=8, max_num_seqs=2, cpu_offload_gib=0)
    for i, prompt in enumerate(random_prompts(3, 512, (8, 8), seed=6)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True), prompt_index=i)
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
    assert [(r["prompt_index"], r["num_preemptions"]) for r in rows] == [(0, 0), (1, 1), (2, 0)]


def filtered(logits: list[list[float]], values: list[tuple[float, int, float, float, bool]]) -> torch.Tensor:
    """`filtered_logits` of rows `logits` under per-row sampling values (as `Group.sampling_values`)."""
    rows = np.array(values, np.float64)
    arrays, flags = sampling_arrays(rows, np.zeros(len(rows), np.uint64), np.zeros(len(rows), np.int64))
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    return filtered_logits(torch.tensor(logits), sampling_batch(tensors, flags))


def test_top_k_keeps_each_rows_own_k_beside_a_larger_one():
    """Rows of one step with different `top_k` keep their own k tokens each (the k-th largest is read from the
    step's top max_top_k)."""
    logits = [[float(v) for v in range(8)]] * 3
    kept = filtered(logits, [(1.0, 2, 1.0, 0.0, False), (1.0, 5, 1.0, 0.0, False), (1.0, 0, 1.0, 0.0, False)])
    assert kept.isfinite().sum(dim=-1).tolist() == [2, 5, 8]


def test_top_p_keeps_the_fewest_tokens_that_reach_it():
    """Four equally likely tokens under top_p=0.5: the first two reach it exactly, so the third is dropped."""
    kept = filtered([[0.0] * 4], [(1.0, 0, 0.5, 0.0, False)])
    assert kept.isfinite().tolist() == [[True, True, False, False]]


def test_a_continue_update_keeps_the_kv_of_decoding_samples(qwen3):
    """Samples already decoding when a "continue" update lands go on from their KV: nothing of theirs is computed
    again (only prompts in prefill, and contexts part way through a recompute, restart)."""
    engine = make_engine(qwen3, block_size=4)
    prompt = random_prompts(1, 512, (10, 10), seed=24)[0]
    engine.add_request(prompt, SamplingParams(n=2, temperature=0, max_new_tokens=8, ignore_eos=True))
    rows = engine.step() + engine.step() + engine.step()
    engine.update_weights(engine.state_dict(), version=1)
    while engine.has_unfinished():
        rows += engine.step()
    stats = engine.stats()
    assert len(rows) == 2 and all(r["policy_version"] == 1 for r in rows)
    assert (stats["prefill_tokens"], stats["recomputed_tokens"], stats["decode_tokens"]) == (10, 0, 2 * 7)


def test_min_p_keeps_tokens_exactly_at_its_threshold():
    """min_p drops tokens less likely than min_p times the top one: at min_p=1 the tokens tied with the top stay."""
    kept = filtered([[0.0, 0.0, -1.0]], [(1.0, 0, 1.0, 1.0, False)])
    assert kept.isfinite().tolist() == [[True, True, False]]


def test_inverse_cdf_never_draws_a_token_without_mass():
    """A uniform of exactly 0 (one draw in 2**53) takes the first token with mass, even past whole chunks and
    tokens of zero probability, as does every other uniform."""
    probs = torch.zeros(3, 200)
    probs[:, 100], probs[:, 150] = 0.25, 0.75
    tokens = inverse_cdf(probs, torch.tensor([0.0, 0.2, 0.9], dtype=torch.float64))
    assert tokens.tolist() == [100, 100, 150]


def test_greedy_samples_beside_sampled_ones_take_the_argmax_and_report_raw_logprobs(qwen3):
    """Greedy samples, with filters set or not, take the argmax and report the model's own logprobs also in a
    step whose other rows sample (and report processed ones): the same as when they run alone."""
    prompts = random_prompts(3, 512, (12, 12), seed=25)
    plain = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    filters = SamplingParams(temperature=0, top_k=2, top_p=0.5, max_new_tokens=4, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4, ignore_eos=True, seed=0)
    mixed = run(make_engine(qwen3), prompts, [filters, plain, sampled])
    alone = run(make_engine(qwen3), prompts[:2], plain)
    for i in range(2):
        assert mixed[(i, 0)]["token_ids"] == alone[(i, 0)]["token_ids"]
        assert mixed[(i, 0)]["logprobs"] == pytest.approx(alone[(i, 0)]["logprobs"], abs=1e-5)


def test_seeded_noise_differs_between_prompts():
    """The noise of a seeded sample is keyed by its prompt too: two prompts under one seed draw different
    uniforms at every position."""
    positions = np.arange(64, dtype=np.uint64)
    a, b = (uniforms(np.full(64, sample_key(7, prompt_hash(p), 0), np.uint64), positions) for p in ([5, 6], [5, 7]))
    assert not np.isclose(a, b).any()


def test_a_finish_drain_admits_no_queued_request(qwen3):
    """A "finish" update drains the started samples on the old weights but admits nothing new, even when one
    ends and frees room while another still drains: the request queued behind them runs on the new weights."""
    engine = make_engine(qwen3, max_num_seqs=2)
    for i, (prompt, new) in enumerate(zip(random_prompts(3, 512, (8, 8), seed=26), (2, 8, 4))):
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True), prompt_index=i)
    rows = engine.step()
    rows += engine.update_weights(engine.state_dict(), version=1, mode="finish")
    assert sorted((r["prompt_index"], r["policy_version"]) for r in rows) == [(0, 0), (1, 0)]
    while engine.has_unfinished():
        rows += engine.step()
    assert (rows[2]["prompt_index"], rows[2]["first_policy_version"]) == (2, 1)


def test_a_finish_drain_readmits_a_preempted_sample_ahead_of_a_restarted_prompt(qwen3):
    """A "finish" update lands while a sample preempted for recompute waits and a newer prompt is in chunked
    prefill: the prompt restarts first in line, but the drain readmits the started sample ahead of it and finishes
    it on the old weights (left behind the prompt, which a drain never admits, nothing could be scheduled). The
    newest are preempted first, so the sample is preempted here by hand, as a newer sample would be."""
    engine = make_engine(qwen3, block_size=4, num_blocks=64, max_batch_tokens=8, cpu_offload_gib=0)
    short, long = random_prompts(1, 512, (4, 4), seed=3)[0], random_prompts(1, 512, (24, 24), seed=4)[0]
    engine.add_request(short, SamplingParams(n=2, temperature=0, max_new_tokens=16, ignore_eos=True), prompt_index=0)
    engine.add_request(long, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True), prompt_index=1)
    rows, scheduler = [], engine.scheduler
    while not (sum(s.started for s in scheduler.running) == 2 and any(not s.started for s in scheduler.running)):
        assert engine.has_unfinished(), "the short prompt's samples never decoded while the long one was in prefill"
        rows += engine.step()
    scheduler._preempt(next(s for s in scheduler.running if s.started), Batch())
    assert any(s.started for s in scheduler.waiting)
    rows += engine.update_weights(engine.state_dict(), version=1, mode="finish")
    while engine.has_unfinished():
        rows += engine.step()
    versions = sorted((r["prompt_index"], r["sample_index"], r["first_policy_version"], r["policy_version"])
                      for r in rows)
    assert versions == [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 1, 1)]


def test_a_stop_token_that_is_also_the_last_allowed_token_ends_with_stop(qwen3):
    """A sample whose stop token comes exactly at `max_new_tokens` ends for "stop", not "length"."""
    prompt = random_prompts(1, 512, (8, 8), seed=27)[0]
    free = run(make_engine(qwen3), [prompt], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    tokens = free[(0, 0)]["token_ids"]
    assert tokens[3] not in tokens[:3]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, stop_token_ids=[tokens[3]])
    row = run(make_engine(qwen3), [prompt], params)[(0, 0)]
    assert (row["token_ids"], row["finish_reason"]) == (tokens[:4], "stop")


def test_abort_of_a_prompt_in_prefill_returns_a_row_per_wanted_sample(qwen3):
    """Aborting a 3-sample prompt still in chunked prefill (not forked yet) returns its 3 rows, and forgets it."""
    engine = make_engine(qwen3, max_batch_tokens=16)
    request = engine.add_request(random_prompts(1, 512, (40, 40), seed=28)[0],
                                 SamplingParams(n=3, max_new_tokens=4, ignore_eos=True))
    assert engine.step() == []
    rows = engine.abort(request)
    assert sorted((r["sample_index"], r["finish_reason"], len(r["token_ids"])) for r in rows) == [
        (0, "abort", 0), (1, "abort", 0), (2, "abort", 0)]
    assert_nothing_leaked(engine)


def test_without_async_batching_a_step_returns_the_rows_it_finished(qwen3):
    """With async batching off, the step that samples a request's last token returns its row."""
    engine = make_engine(qwen3, async_batching=False)
    engine.add_request(random_prompts(1, 512, (8, 8), seed=29)[0], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert [len(r["token_ids"]) for r in engine.step()] == [1]
    assert not engine.has_unfinished()


def test_an_interrupted_generate_drops_rows_its_abort_collected(qwen3):
    """With async batching, Ctrl-C in the step after the one that finished a sample: the abort collects that
    step, and its row, this call's, never comes out of the next call."""
    engine = make_engine(qwen3, async_batching=True)
    with ctrl_c_at_step(engine, 2):
        engine.generate(random_prompts(2, 512, (8, 8), seed=30), SamplingParams(max_new_tokens=1, ignore_eos=True))
    table = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert table.num_rows == 1 and table.column("prompt_token_ids").to_pylist() == [[5, 6, 7]]


def test_a_cpu_pool_exactly_the_size_of_the_victim_takes_it(qwen3):
    """The preempted request holds 3 blocks and the CPU pool has exactly 3: it is offloaded, not recomputed."""
    engine = make_engine(qwen3, block_size=4, num_blocks=7, cpu_offload_gib=3 * gib_per_block(qwen3, 4),
                         enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    run(engine, random_prompts(2, 512, (8, 8), seed=6), params)
    stats = engine.stats()
    assert (stats["cpu_blocks_total"], stats["offloads"], stats["restores"], stats["recomputes"]) == (3, 1, 1, 0)


@pytest.mark.parametrize("mode, new_tokens", [("continue", 1), ("finish", 3)])
def test_an_update_returns_the_rows_of_samples_ended_in_steps_in_flight(qwen3, mode, new_tokens):
    """With async batching, rows of samples that end in the step in flight when an update lands, or in the last
    step of a "finish" drain, come back from `update_weights` itself, every step collected before the copy."""
    engine = make_engine(qwen3, async_batching=True)
    engine.add_request(random_prompts(1, 512, (8, 8), seed=31)[0],
                       SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    assert engine.step() == []
    rows = engine.update_weights(engine.state_dict(), version=1, mode=mode)
    assert [(len(r["token_ids"]), r["policy_version"]) for r in rows] == [(new_tokens, 0)]
    assert not engine.has_unfinished()


def test_staged_arrays_are_16_byte_aligned():
    """Packed into one buffer, each array's view starts 16-byte aligned whatever the sizes before it (Triton
    kernels are compiled for aligned pointers)."""
    views = Staging(torch.device("cpu"), pack=True).send(
        {"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.int64), "c": np.ones(2, np.float32)})
    assert all(v.data_ptr() % 16 == 0 for v in views.values())
    assert [v.tolist() for v in views.values()] == [[0, 1, 2], [0, 1, 2, 3, 4], [1.0, 1.0]]

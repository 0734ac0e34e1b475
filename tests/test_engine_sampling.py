"""Fork, seeds and the sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout import SamplingParams
from tests.conftest import hf_model, make_engine, random_prompts, run
from tests.test_engine_parity import exact_distribution, reference_logprobs
from workers.engine import sampler
from workers.engine.sampler import expanded_rows, sample, sampling_arrays, sampling_batch
from workers.engine.sequence import Group, Sequence


@pytest.fixture(scope="module")
def qwen3(model_dir):
    return model_dir("qwen3")


def test_fork_prefills_once_and_greedy_children_agree(qwen3):
    prompts = random_prompts(5, 512, (20, 50), seed=1)
    engine = make_engine(qwen3, max_batch_tokens=64)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    rows8 = run(engine, prompts, SamplingParams(n=8, temperature=0, max_new_tokens=16, ignore_eos=True))
    stats = engine.stats()
    assert stats["prefill_tokens"] == sum(map(len, prompts))
    assert stats["forks"] == 5 * 7
    rows1 = run(make_engine(qwen3), prompts, greedy)
    for i in range(len(prompts)):
        for s in range(8):
            assert rows8[(i, s)]["token_ids"] == rows1[(i, 0)]["token_ids"]
            assert rows8[(i, s)]["logprobs"] == pytest.approx(rows1[(i, 0)]["logprobs"], abs=1e-5)


@pytest.mark.parametrize("prompt_len", [32, 37])  # block-aligned and with a partial last block
def test_sampled_children_differ_and_share_blocks(qwen3, prompt_len):
    prompt = random_prompts(1, 512, (prompt_len, prompt_len), seed=2)[0]
    engine = make_engine(qwen3, block_size=16)
    engine.add_request(prompt, SamplingParams(n=8, max_new_tokens=20, seed=5, ignore_eos=True))
    engine.step()
    engine.check_integrity()
    tables = [s.block_table for s in engine.scheduler.running]
    full = prompt_len // 16
    assert len(tables) == 8 and all(t[:full] == tables[0][:full] for t in tables)
    assert engine.pool.ref_counts[tables[0][0]] == 8, "complete prompt blocks are shared by all children"
    if prompt_len % 16:
        assert len({t[full] for t in tables}) == 8, "each child owns a copy of the partial block"
    rows = {}
    while engine.has_unfinished():
        rows.update((row["sample_index"], row) for row in engine.step())
        engine.check_integrity()
    assert len({tuple(row["token_ids"]) for row in rows.values()}) == 8


def test_fork_after_a_one_token_prefill_chunk(qwen3):
    """A 17-token prompt in chunks of 8, 8 and 1: the last chunk still forks with a partial block per
    child (shared, children would overwrite each other's KV; logprobs show it, greedy does not)."""
    prompt = random_prompts(1, 512, (17, 17), seed=9)[0]
    params = SamplingParams(n=3, max_new_tokens=6, seed=0, ignore_eos=True, logprobs_mode="raw")
    rows = run(make_engine(qwen3, max_batch_tokens=8), [prompt], params)
    model = hf_model(qwen3)
    for s in range(3):
        want = reference_logprobs(model, prompt, rows[(0, s)]["token_ids"], params)
        assert rows[(0, s)]["logprobs"] == pytest.approx(want, abs=1e-4), f"sample {s}"


def test_tiny_temperature_is_greedy(qwen3):
    """Below 1e-5 the temperature counts as 0: logits / T would overflow to nan."""
    prompt = random_prompts(1, 512, (10, 10), seed=10)
    greedy = run(make_engine(qwen3), prompt, SamplingParams(temperature=0, max_new_tokens=8))
    tiny = run(make_engine(qwen3), prompt, SamplingParams(temperature=1e-39, max_new_tokens=8))
    assert tiny[(0, 0)]["token_ids"] == greedy[(0, 0)]["token_ids"]
    assert tiny[(0, 0)]["logprobs"] == greedy[(0, 0)]["logprobs"]


def test_seeded_sample_independent_of_batch(qwen3):
    target = random_prompts(1, 512, (25, 25), seed=3)[0]
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, max_new_tokens=20, seed=1234, ignore_eos=True)
    alone = run(make_engine(qwen3), [target], params)
    others = random_prompts(30, 512, (5, 60), seed=4)
    mixed = [SamplingParams(n=2, temperature=1.0, max_new_tokens=10 + i % 7, ignore_eos=True) for i in range(30)]
    crowd = run(make_engine(qwen3, block_size=8, max_batch_tokens=40), others + [target], mixed + [params])
    for s in range(4):
        assert crowd[(30, s)]["token_ids"] == alone[(0, s)]["token_ids"]
        assert crowd[(30, s)]["logprobs"] == pytest.approx(alone[(0, s)]["logprobs"], abs=1e-5)


def test_unseeded_requests_differ(qwen3):
    prompt = random_prompts(1, 512, (10, 10), seed=5)
    a = run(make_engine(qwen3), prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    b = run(make_engine(qwen3), prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert a[(0, 0)]["token_ids"] != b[(0, 0)]["token_ids"]


def test_copies_of_a_prompt_in_one_seeded_call_draw_different_samples(qwen3):
    """A prompt given twice with n = 2 and a seed gets the 4 samples of that prompt with n = 4, not the same 2
    twice (a GRPO group of identical samples has no signal); a prompt given once keeps its samples."""
    prompt, other = random_prompts(2, 512, (12, 12), seed=7)
    params = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=99)
    table = make_engine(qwen3).generate([prompt, other, prompt], SamplingParams(n=2, **params))
    tokens = table["token_ids"].to_pylist()
    wide = make_engine(qwen3).generate([prompt], SamplingParams(n=4, **params))["token_ids"].to_pylist()
    assert tokens[:2] + tokens[4:] == wide and len({tuple(t) for t in wide}) == 4
    alone = make_engine(qwen3).generate([other], SamplingParams(n=2, **params))
    assert tokens[2:4] == alone["token_ids"].to_pylist()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=12),
    dict(temperature=1.5, top_p=0.7),
    dict(temperature=1.2, min_p=0.1),
    dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
], ids=str)
def test_first_token_distribution_chi_square(qwen3, params):
    n = 3000
    prompt = random_prompts(1, 512, (32, 32), seed=6)[0]
    p = SamplingParams(n=n, max_new_tokens=1, seed=2024, **params)
    engine = make_engine(qwen3, max_num_seqs=n, num_blocks=64)
    rows = run(engine, [prompt], p)
    counts = torch.zeros(512)
    for s in range(n):
        counts[rows[(0, s)]["token_ids"][0]] += 1
    with torch.no_grad():
        logits = hf_model(qwen3)(torch.tensor([prompt])).logits[0, -1]
    probs = exact_distribution(logits, p)
    assert counts[probs == 0].sum() == 0, "a filtered-out token was sampled"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    result = chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e} over {int(keep.sum())} bins"


def test_top_k_1_is_exactly_greedy_on_tied_logits():
    """top_k=1 over tied maxima (common in bf16) takes the lowest index every time, with the filtered
    distribution's logprob 0, whatever the row's uniform number."""
    logits = torch.zeros(64, 8)
    logits[:, [2, 5]] = 3.0
    tokens, logprobs = sample(logits, _batch([_seq(SamplingParams(top_k=1, seed=s)) for s in range(64)]))
    assert tokens.tolist() == [2] * 64 and logprobs.tolist() == [0.0] * 64


def test_top_p_keeps_the_lower_ids_of_tokens_tied_at_its_cut():
    """Three tied tokens, top_p=0.5: the first two by id pass (transformers would keep the last two), in any
    batch, as SamplingParams documents."""
    logits = torch.full((2, 8), -10.0)
    logits[:, [1, 4, 6]] = 2.0
    kept = sampler.filtered_logits(logits, _batch([_seq(SamplingParams(top_p=0.5, seed=s)) for s in range(2)]))
    assert (kept > float("-inf")).nonzero()[:, 1].tolist() == [1, 4, 1, 4]


@pytest.mark.parametrize("mate", [dict(top_k=12), dict(top_k=1), dict(top_p=0.5), dict(min_p=0.1),
                                  dict(temperature=0.5), dict(temperature=0.0), dict(logprobs_mode="raw")], ids=str)
def test_rows_that_filter_nothing_are_sampled_alike_whatever_their_batch_mates_ask(mate):
    """Rows at temperature 1 with no filter get the same filtered logits, tokens and logprobs alone as beside a
    row that filters. Over a peaked 150k vocabulary, float32 sums of the sorted probabilities reach 1 long
    before the tail, so a top-p of 1 must mean no top-p at all."""
    torch.manual_seed(0)
    logits = torch.randn(9, 151_936) * 4
    logits[:, :10] += 25
    plain = [_seq(SamplingParams(temperature=1.0, seed=s)) for s in range(8)]
    alone, mixed = _batch(plain), _batch(plain + [_seq(SamplingParams(seed=99, **mate))])
    assert torch.equal(sampler.filtered_logits(logits[:8], alone), sampler.filtered_logits(logits, mixed)[:8])
    tokens, logprobs = sample(logits[:8], alone)
    mixed_tokens, mixed_logprobs = sample(logits, mixed)
    assert torch.equal(tokens, mixed_tokens[:8]) and torch.equal(logprobs, mixed_logprobs[:8])


def _batch(seqs: list[Sequence]) -> sampler.SamplingBatch:
    values, keys, _ = expanded_rows(seqs)
    arrays, flags = sampling_arrays(values, keys, np.arange(len(seqs)))
    return sampling_batch({k: torch.from_numpy(v) for k, v in arrays.items()}, flags)


def _seq(params: SamplingParams) -> Sequence:
    group = Group("r", 0, [1, 2], params, params.seed, 0, frozenset(), 64, 1)
    return Sequence(group, [0], [1, 2])

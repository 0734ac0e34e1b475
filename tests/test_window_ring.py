"""Sliding-window layers that keep only their window, in a ring of blocks per row (window_ring.py): the
same samples as a cache of every token, bit for bit, through forks, chunked prefill, offload, recompute,
decode graphs and the Triton kernels; and the memory they take."""

from __future__ import annotations

import os

import pytest
import torch

from rollout import SamplingParams
from rollout.config import EngineConfig
from tests.conftest import DEVICES, make_engine, random_prompts, run
from tests.model_zoo import VOCAB
from workers.engine.sequence import cdiv
from workers.engine.window_ring import RING_KEYS

WINDOW = 12  # every windowed zoo entry's
# rings of cdiv(11 + 16, 8) = 4 blocks (32 tokens): prompts of up to 70 tokens prefill in chunks of 16
# beside each other, and 48 new tokens wrap every ring several times
SMALL = dict(block_size=8, max_batch_tokens=16, max_num_seqs=16)
PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=5, logprobs_mode="raw")


def prompts() -> list[list[int]]:
    """A long prompt first, so that its later chunks fill whole steps (the ring's tightest case: W - 1 keys
    before a chunk of max_batch_tokens), then shorter ones beside each other."""
    return random_prompts(1, VOCAB, (70, 70), seed=10) + random_prompts(4, VOCAB, (3, 50), seed=11)


def assert_same_rows(got: dict, want: dict, exact: bool = True) -> None:
    """Same samples; with `exact`, bit for bit (else the logprobs within 1e-4: other batches, other rounding)."""
    assert got.keys() == want.keys()
    for key in want:
        assert got[key]["token_ids"] == want[key]["token_ids"], key
        assert got[key]["finish_reason"] == want[key]["finish_reason"], key
        logprobs = want[key]["logprobs"] if exact else pytest.approx(want[key]["logprobs"], abs=1e-4)
        assert got[key]["logprobs"] == logprobs, key


@pytest.fixture(scope="module")
def full_rows(zoo_dir):
    """Per model, the rows of a roomy engine that keeps every token of every layer."""
    cache = {}

    def rows(name: str) -> dict:
        if name not in cache:
            engine = make_engine(zoo_dir(name), windowed_kv="full", enable_prefix_caching=False, **SMALL)
            assert not engine.runner.layout.rings
            cache[name] = run(engine, prompts(), PARAMS)
        return cache[name]
    return rows


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "mistral", "gemma3n_text"])
def test_rings_give_the_full_cache_samples_bit_for_bit(zoo_dir, full_rows, name):
    """Windowed and full layers mixed (gpt-oss, with sinks; Gemma 2), every layer windowed (Mistral), and
    layers reading another's windowed K/V (Gemma 3n): masked keys weigh exactly zero, so a ring's stale
    slots change nothing."""
    engine = make_engine(zoo_dir(name), windowed_kv="window", **SMALL)
    layout = engine.runner.layout
    assert layout.rings and engine.runner.ring_blocks == cdiv(WINDOW - 1 + 16, 8) == 4
    assert_same_rows(run(engine, prompts(), PARAMS), full_rows(name))


@pytest.mark.parametrize("config", [dict(async_batching=True), dict(cuda_graphs=(False, True))],
                         ids=["async", "graphs"])
def test_rings_through_async_batching_and_decode_graphs(zoo_dir, full_rows, config):
    engine = make_engine(zoo_dir("gpt_oss"), windowed_kv="window", **SMALL, **config)
    got = run(engine, prompts(), PARAMS)
    if "cuda_graphs" in config:
        assert engine.runner.graphs.replays > 0
    assert_same_rows(got, full_rows("gpt_oss"), exact="async_batching" in config)


@pytest.mark.parametrize("device", DEVICES)
def test_rings_through_the_triton_kernels(zoo_dir, device):
    """The Triton kernels (compiled on a GPU, interpreted on the CPU) store into and read from the rings;
    padded decode graphs. On the CPU gpt-oss (sinks too); on a GPU Gemma 2, whose dense float32 decode step
    captures (float32 MoE experts do not)."""
    pytest.importorskip("triton")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU runs in its interpreter: TRITON_INTERPRET=1 (set where there is no GPU)")
    path, small = zoo_dir("gpt_oss" if device == "cpu" else "gemma2"), random_prompts(2, VOCAB, (20, 40), seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=5, logprobs_mode="raw")
    want = run(make_engine(path, windowed_kv="full", device=device, attention_backend="torch", **SMALL), small, params)
    engine = make_engine(path, windowed_kv="window", attention_backend="triton", cuda_graphs=(False, True),
                         device=device, **SMALL)
    assert type(engine.runner.backend).__name__ == "TritonBackend" and engine.runner.layout.rings
    got = run(engine, small, params)
    assert engine.runner.graphs.replays > 0
    assert_same_rows(got, want, exact=False)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "recompute"])
def test_rings_survive_preemption(zoo_dir, full_rows, offload):
    """A cache too small for every sample preempts them: the offloaded carry their rings to the CPU pool and
    back, the recomputed write theirs afresh; samples are unchanged."""
    engine = make_engine(zoo_dir("gpt_oss"), windowed_kv="window", num_blocks=40,
                         cpu_offload_gib=0.01 if offload else 0.0, **SMALL)
    assert_same_rows(run(engine, prompts(), PARAMS), full_rows("gpt_oss"), exact=False)
    stats = engine.stats()
    assert stats["restores"] > 0 if offload else stats["recomputes"] > 0, stats


def test_ring_layers_take_no_paged_blocks(zoo_dir):
    """gpt-oss's windowed layers leave the paged blocks to its full layers: half the bytes per block. Each
    ring layer keeps K and V of `ring_blocks` blocks per row (and one spare row for graph padding)."""
    path = zoo_dir("gpt_oss")
    full = make_engine(path, windowed_kv="full", **SMALL).runner
    window = make_engine(path, windowed_kv="window", **SMALL)
    runner = window.runner
    assert sorted(runner.layout.rings) == [0, 2] and runner.layout.windows == (WINDOW, None, WINDOW, None)
    assert runner.bytes_per_block * 2 == full.bytes_per_block
    heads, dim = runner.layout.shapes[0]
    for layer in (0, 2):
        for key in RING_KEYS:
            assert runner.states.tensors[layer, key, 0].shape == (SMALL["max_num_seqs"] + 1, 4, 8, heads, dim)
    assert not window.config.enable_prefix_caching and full.states is None


def test_auto_keeps_rings_only_where_they_cost_no_capacity(zoo_dir):
    """"auto": rings when max_num_seqs + 1 of them fit in the tokens a full cache of the budget holds (256
    blocks of 8 here): 17 rings of 32 tokens do, not in 60 blocks; 257 rings of 272 tokens (1024-token
    steps, whose prompt chunks rings cap at 256 tokens) do not. Rings come out of the budget."""
    path = zoo_dir("gemma2")
    runner = make_engine(path, **SMALL).runner
    assert runner.layout.rings and runner.states.nbytes == 17 * 32 * 2 * 2 * 8 * 4  # K and V of 2 heads x 8
    assert not make_engine(path, **{**SMALL, "num_blocks": 60}).runner.layout.rings
    assert make_engine(path, **{**SMALL, "num_blocks": 60}, windowed_kv="window").runner.layout.rings
    assert not make_engine(path, block_size=8, max_batch_tokens=1024).runner.layout.rings
    runner = make_engine(path, block_size=8, max_batch_tokens=1024, windowed_kv="window").runner
    assert (runner.ring_blocks, runner.max_chunk) == (cdiv(WINDOW - 1 + 256, 8), 256)
    budget = dict(SMALL, num_blocks=None, kv_cache_memory_gib=0.0003)
    sized, full = make_engine(path, **budget).runner, make_engine(path, **budget, windowed_kv="full").runner
    assert sized.layout.rings and sized.kv_cache.nbytes + sized.states.nbytes <= 0.0003 * 2**30
    assert sized.num_blocks * sized.block_size > full.num_blocks * full.block_size
    assert not make_engine(zoo_dir("llama_stray_window"), windowed_kv="window", **SMALL).runner.layout.rings


def test_forced_rings_that_leave_too_little_budget_are_named(zoo_dir):
    """34,816 bytes of rings out of a 40,000-byte budget leave 5 blocks, fewer than one sequence needs."""
    with pytest.raises(ValueError, match=r"fewer than the 32 .* windowed layers' rings\) takes 0.00 GiB"):
        make_engine(zoo_dir("gemma2"), **dict(SMALL, num_blocks=None), kv_cache_memory_gib=40_000 / 2**30,
                    windowed_kv="window")


def test_unknown_windowed_kv_is_refused():
    with pytest.raises(ValueError, match=r"windowed_kv='ring' must be one of \('auto', 'window', 'full'\)"):
        EngineConfig(model="m", windowed_kv="ring")


def test_a_long_decode_wraps_the_ring_many_times(zoo_dir):
    """Greedy through 200 tokens (each ring wraps six times) equals transformers' `generate`."""
    from tests.conftest import hf_model
    path = zoo_dir("gemma2")
    prompt = random_prompts(1, VOCAB, (20, 20), seed=3)[0]
    want = hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 20, dtype=torch.long),
                                   max_new_tokens=200, do_sample=False)[0, 20:].tolist()
    engine = make_engine(path, windowed_kv="window", **SMALL)
    rows = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True))
    assert rows[(0, 0)]["token_ids"] == want


def test_prompt_chunks_are_capped_to_what_a_ring_holds(model_dir):
    """With 1024-token steps a ring model computes at most 256 prompt tokens of a sequence per step (its ring
    holds window - 1 + 256): a 700-token prompt takes three steps beside a short one, and both samples
    equal `generate`'s."""
    from tests.conftest import hf_model
    path = model_dir("gemma2", max_position_embeddings=2048)
    engine = make_engine(path, max_batch_tokens=1024, max_num_seqs=4)
    assert engine.runner.layout.rings and engine.scheduler.max_chunk == 256
    prompts = random_prompts(2, 512, (700, 700), seed=4)
    prompts[1] = prompts[1][:30]
    model = hf_model(path)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True), prompt_index=i)
    computed = []
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
        computed.append(engine.stats()["prefill_tokens"])
    assert computed[:3] == [256 + 30, 512 + 30, 700 + 30]
    for row in rows:
        prompt = prompts[row["prompt_index"]]
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        assert row["token_ids"] == want

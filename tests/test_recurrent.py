"""Linear-attention and state-space hybrids (workers/engine/recurrent.py): each sequence's state kept in
its slot through chunked prefill, batched decode, forks, preemption and async batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from tests.conftest import DEVICES, hf_model, make_engine, run
from tests.test_model_coverage import forward_logprobs, greedy_references, prompts_of
from workers.engine import recurrent
from workers.engine.recurrent import _segments

# a one-token prompt (its state starts beside decoding ones), short ones, and long ones prefilled in chunks
LENGTHS = [3, 26, 40, 1, 37, 17]
MODEL = "qwen3_5_text"


def assert_every_sample_exact(path: str, n: int, reference_device: str = "cpu", logprob_abs: float = 1e-4,
                              **config) -> dict:
    """Greedy samples of every prompt are `generate`'s tokens with a plain forward's logprobs (computed on
    `reference_device`), all `n` of each (a fork's children start from the prompt's state); returns the
    engine's stats."""
    prompts = prompts_of(LENGTHS)
    model = hf_model(path).to(reference_device)
    expected = greedy_references(model, prompts)
    engine = make_engine(path, **{"block_size": 8, "max_batch_tokens": 16, "max_num_seqs": 8, **config})
    rows = run(engine, prompts, SamplingParams(n=n, temperature=0, max_new_tokens=10, logprobs_mode="raw"))
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        logprobs = forward_logprobs(model, prompt, want)
        for s in range(n):
            assert rows[(i, s)]["token_ids"] == want, f"prompt {i} sample {s}"
            assert rows[(i, s)]["logprobs"] == pytest.approx(logprobs, abs=logprob_abs), f"prompt {i} sample {s}"
    return engine.stats()


def test_forked_samples_start_from_the_prompts_state(zoo_dir):
    stats = assert_every_sample_exact(zoo_dir(MODEL), n=3)
    assert stats["forks"] == 2 * len(LENGTHS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "recompute"])
@pytest.mark.parametrize("name", [MODEL, "mamba2"])
def test_preempted_sequences_keep_their_state(zoo_dir, name, offload, async_batching, device):
    """A cache too small for every sample preempts: a sequence offloaded takes its state to the CPU pool and
    back into whatever row it gets; one recomputed starts from zero state. Decode steps take the graphs'
    padded path (captured on a GPU), whose padding rows write a spare slot. Mamba-2 has no attention: its
    blocks only bound each sequence's length."""
    stats = assert_every_sample_exact(zoo_dir(name), n=2, num_blocks=12, async_batching=async_batching,
                                      cuda_graphs=(False, True), cpu_offload_gib=0.5 if offload else 0,
                                      device=device)
    assert stats["cached_prefix_tokens"] == 0
    assert stats["restores"] > 0 if offload else stats["recomputes"] > 0 and stats["offloads"] == 0


def test_feed_forward_blocks_beside_mixers_through_forks_and_preemption(zoo_dir):
    """Nemotron-H's published patterns put MLP ("-") and MoE ("E") blocks, neither attention nor state,
    between its Mamba and attention layers."""
    stats = assert_every_sample_exact(zoo_dir("nemotron_h_blocks"), n=2, num_blocks=12, cpu_offload_gib=0.5)
    assert stats["forks"] > 0 and stats["restores"] > 0


def test_aborting_an_offloaded_sample_frees_its_state_slot(zoo_dir):
    """A request aborted while one of its samples waits in the CPU pool gives back that sample's recurrent-state
    slot with its blocks (the integrity check accounts for every slot), and the other requests run on."""
    engine = make_engine(zoo_dir(MODEL), block_size=8, max_batch_tokens=16, num_blocks=12, cpu_offload_gib=0.5)
    for i, prompt in enumerate(prompts_of(LENGTHS)):
        engine.add_request(prompt, SamplingParams(n=2, temperature=0, max_new_tokens=10), request_id=str(i))
    offloaded = engine.scheduler.offloader.offloaded
    while not offloaded:
        assert engine.has_unfinished(), "no sample was offloaded"
        engine.step()
    engine.abort(offloaded[0].group.request_id)
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.stats()["restores"] > 0


def test_the_cpu_pool_keeps_a_state_slot_per_offloaded_sequence(zoo_dir):
    """State slots take up to half the pool, at most one per sequence, and KV blocks the rest, at most what
    every sequence could hold (here 4 sequences of 256 tokens: 128 blocks of 8)."""
    engine = make_engine(zoo_dir(MODEL), block_size=8, max_num_seqs=4, cpu_offload_gib=1 / 1024)
    pool = engine.cpu_pool
    assert {key: tuple(t.shape) for key, t in pool.state_slots.items()} == {
        (0, "conv", 0): (4, 64, 4), (0, "recurrent", 0): (4, 4, 8, 8)}
    assert pool.num_blocks == 128 < (2**20 - 4 * 2048) // pool.bytes_per_block
    small = make_engine(zoo_dir(MODEL), block_size=8, max_num_seqs=4, cpu_offload_gib=5000 / 2**30).cpu_pool
    assert len(small.free_states) == 1 and small.num_blocks == (5000 - 2048) // small.bytes_per_block


def test_a_cpu_pool_without_room_for_one_state_slot_warns_and_keeps_no_block(zoo_dir):
    """Half of 3000 bytes holds no 2048-byte state slot: no sequence can be offloaded, and the pool's KV blocks
    were allocated and never used, without a word."""
    with pytest.warns(UserWarning, match=r"holds no per-sequence state slot \(2048 bytes each, in at most 50% of "
                                         r"the pool\): preempted requests are recomputed; offloading one needs at "
                                         r"least 3.815e-06 GiB"):
        pool = make_engine(zoo_dir(MODEL), block_size=8, max_num_seqs=4, cpu_offload_gib=3000 / 2**30).cpu_pool
    assert pool.num_states == pool.num_blocks == 0


def test_a_repeated_prompt_is_computed_again_not_taken_from_the_prefix_cache(zoo_dir):
    engine = make_engine(zoo_dir(MODEL), block_size=8)
    assert not engine.config.enable_prefix_caching
    prompt = prompts_of([30])[0]
    params = SamplingParams(temperature=0, max_new_tokens=5, logprobs_mode="raw")
    first, second = (run(engine, [prompt], params)[(0, 0)] for _ in range(2))
    assert second["token_ids"] == first["token_ids"] and second["logprobs"] == first["logprobs"]
    assert engine.stats()["cached_prefix_tokens"] == 0


def test_state_slots_have_each_layers_shapes(zoo_dir):
    """One slot per block-table row, one for padding rows and one kept zero; Qwen3.5's Gated DeltaNet layer
    (layer 0) keeps a window of 4 inputs of q, k and v (2 x 2 heads x 8 + 4 heads x 8) and a 4-head 8 x 8
    state, in float32."""
    runner = make_engine(zoo_dir(MODEL), max_num_seqs=5).runner
    shapes = {key: tuple(t.shape) for key, t in runner.states.tensors.items()}
    assert shapes == {(0, "conv", 0): (7, 64, 4), (0, "recurrent", 0): (7, 4, 8, 8)}
    assert (runner.states.pad_slot, runner.states.zero_slot) == (5, 6)
    assert runner.layout.shapes[0] is None and runner.kv_cache.layers[0] is None
    assert runner.states.tensors[(0, "recurrent", 0)].dtype == torch.float32


def test_a_steps_sequences_split_into_runs_of_one_token_and_longer_chunks_alone():
    cu = np.cumsum([0, 1, 1, 5, 1, 3, 3, 1])
    assert _segments(cu) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert _segments(np.array([0, 1, 2, 3])) == [(0, 3)]


@pytest.mark.parametrize("beside", ["decode", "decode+chunk"])
def test_a_sequence_taking_a_used_slot_starts_from_zero_state(zoo_dir, beside):
    """A one-token prompt admitted beside a decoding sequence into the slot a finished sequence left must not
    read that sequence's state: in a step of one-token sequences (one call, through the decode-graph path),
    and in a run of one-token sequences before a longer prompt's chunk."""
    path = zoo_dir(MODEL)
    first, decoding, fresh, long = prompts_of([20, 5, 1, 30])
    engine = make_engine(path, block_size=8, cuda_graphs=(False, True))
    greedy = SamplingParams(temperature=0, max_new_tokens=8, logprobs_mode="raw")
    engine.add_request(first, SamplingParams(temperature=0, max_new_tokens=2), prompt_index=0)
    engine.add_request(decoding, SamplingParams(temperature=0, max_new_tokens=30), prompt_index=1)
    while not any(row["prompt_index"] == 0 for row in engine.step()):
        pass
    engine.add_request(fresh, greedy, prompt_index=2)
    if beside == "decode+chunk":
        engine.add_request(long, greedy, prompt_index=3)
    rows = {}
    while engine.has_unfinished():
        rows.update({row["prompt_index"]: row for row in engine.step()})
    model = hf_model(path)
    want = greedy_references(model, [fresh])[0][:8]
    assert rows[2]["token_ids"] == want
    assert rows[2]["logprobs"] == pytest.approx(forward_logprobs(model, fresh, want), abs=1e-4)


def test_a_model_without_attention_keeps_only_a_placeholder_kv(zoo_dir):
    """Mamba-2: one one-element K/V in layer 0, never read, so blocks are counted as for any model; with no
    position limit in its config, sequences may reach 32768 tokens unless `max_model_len` says less."""
    runner = make_engine(zoo_dir("mamba2"), block_size=8, num_blocks=16).runner
    assert runner.layout.shapes == ((1, 1), None) and runner.bytes_per_block == 2 * 8 * 4
    assert runner.max_model_len == 32768
    assert make_engine(zoo_dir("mamba2"), block_size=8, num_blocks=16, max_model_len=100).max_model_len == 100


def test_a_written_zero_slot_fails_the_integrity_check(zoo_dir):
    """Rows starting afresh read the zero slot, so the engine's integrity check asserts nothing wrote it."""
    engine = make_engine(zoo_dir(MODEL), max_num_seqs=2)
    engine.check_integrity()
    states = engine.runner.states
    states.tensors[(0, "recurrent", 0)][states.zero_slot, 0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match=r"zero state slot was written: \[\(0, 'recurrent', 0\)\]"):
        engine.check_integrity()


@pytest.mark.parametrize("name", [MODEL, "mamba2"])
def test_every_kind_of_mixer_call_is_made_at_start(zoo_dir, monkeypatch, name):
    """Prefill chunks that start a state and chunks that continue one both run in the start-up's warm-up:
    on a GPU, fla compiles and autotunes the kernels of each on first use (18 s for a chunk that reads a
    state, on an H100), which must not stall a request. (Decode batches run when the decode graphs are
    captured, on CUDA only.)"""
    kinds = set()

    def spy(states, rows, fresh, *args) -> recurrent.SlotView:
        kinds.add("decode" if isinstance(fresh, torch.Tensor) else "fresh" if fresh else "continued")
        return view(states, rows, fresh, *args)

    view = recurrent.SlotView
    monkeypatch.setattr(recurrent, "SlotView", spy)
    engine = make_engine(zoo_dir(name), block_size=8, max_batch_tokens=16, max_num_seqs=8)
    at_start = set(kinds)
    run(engine, prompts_of(LENGTHS), SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    assert at_start == {"fresh", "continued"} and kinds == at_start | {"decode"}

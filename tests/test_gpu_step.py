"""The GPU-shaped step on a real GPU: one host wait per decode step (eager and through decode graphs,
with and without async batching, in steps that offload or restore, and with a linear-attention hybrid's
state slots, also in steps that fork its prompts), decode graphs captured at start (also after an engine
dropped in a reference cycle) and replaying like the eager forward, automatic sizing within the card's budget,
and an exact-size pinned CPU pool. Skipped without CUDA (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import gc
import warnings
from typing import Callable

import pytest
import torch

from rollout import SamplingParams
from rollout.config import EngineConfig
from tests.conftest import ON_GPU, make_engine, random_prompts, run
from tests.test_decode_graphs import ENGINE, PARAMS, PROMPTS, checking_replays
from workers.engine import Engine
from workers.engine.memory import PAGE
from workers.engine.sequence import cdiv

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def decode_syncs(engine: Engine, steps: int, monkeypatch, before: Callable[[int], None] | None = None) -> list[int]:
    """Host waits for the device in each of `steps` decode steps: synchronizing CUDA calls (torch's sync
    debug mode) and CUDA event waits (which that mode does not see); `before(i)` runs ahead of step i,
    uncounted."""
    counts, waits = [], []
    wait = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        waits.append(event)
        wait(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for i in range(steps):
            if before is not None:
                before(i)
            waits.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught) + len(waits))
            launched = engine.in_flight.sampled.ready if engine.in_flight else None
            assert all(event is not launched for event in waits), "the step just launched was waited for"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("graphs", [(False, False), (False, True)], ids=["eager", "graphs"])
def test_one_sync_per_decode_step(model_dir, monkeypatch, graphs, async_batching):
    """One wait per step, for the sampled tokens (with async batching, those of the step before)."""
    engine = Engine(EngineConfig(model=model_dir(), device="cuda", max_num_seqs=16, cuda_graphs=graphs,
                                 async_batching=async_batching))
    for i, prompt in enumerate(random_prompts(6, 512, (5, 40), seed=3)):
        params = SamplingParams(temperature=0 if i % 2 else 0.8, top_p=0.9, top_k=20, max_new_tokens=64,
                                seed=i, ignore_eos=True)
        engine.add_request(prompt, params, prompt_index=i)
    while engine.scheduler.waiting or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # staging buffers and allocator pools warm
        engine.step()
    replays = engine.runner.graphs.replays if graphs[1] else 0
    assert decode_syncs(engine, 8, monkeypatch) == [1] * 8
    assert (engine.runner.graphs.replays == replays + 8) if graphs[1] else engine.runner.graphs is None
    engine.check_integrity()


@pytest.mark.parametrize("graphs", [(False, False), (False, True)], ids=["eager", "graphs"])
def test_a_hybrids_state_slots_add_no_host_wait(zoo_dir, monkeypatch, graphs):
    """Qwen3.5's Gated DeltaNet layers, run by transformers' code on their state slots (gathered, updated,
    written back), still leave one wait per decode step."""
    engine = Engine(EngineConfig(model=zoo_dir("qwen3_5_text"), device="cuda", max_num_seqs=16, cuda_graphs=graphs,
                                 async_batching=True))
    for i, prompt in enumerate(random_prompts(6, 128, (5, 40), seed=3)):
        engine.add_request(prompt, SamplingParams(temperature=0.8, max_new_tokens=64, seed=i, ignore_eos=True),
                           prompt_index=i)
    while engine.scheduler.waiting or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    assert decode_syncs(engine, 8, monkeypatch) == [1] * 8
    engine.check_integrity()


def test_a_hybrids_fork_steps_add_no_host_wait(zoo_dir, monkeypatch):
    """Steps that admit and fork a linear-attention hybrid's prompts while others decode (async batching, the
    children's state slots copied from the prompt's): each still waits once, for the step before's tokens. A
    fork step sends inputs twice more after its launch; with two staging buffers taken in strict turn, the
    next step's send waited for that step's whole forward (9c308d2: the next buffer whose copy has landed)."""
    engine = Engine(EngineConfig(model=zoo_dir("qwen3_5_text"), device="cuda", max_num_seqs=32, async_batching=True))
    prompts = random_prompts(12, 128, (5, 40), seed=4)
    engine.add_request(prompts[0], SamplingParams(temperature=0.8, max_new_tokens=64, seed=0, ignore_eos=True),
                       prompt_index=0)
    for _ in range(4):
        engine.step()

    def add(i: int) -> None:
        if i % 2 == 0 and i // 2 + 1 < len(prompts):
            engine.add_request(prompts[i // 2 + 1], SamplingParams(n=2, temperature=0.8, max_new_tokens=32,
                                                                   seed=i, ignore_eos=True), prompt_index=i)

    steps = 2 * (len(prompts) - 1)
    assert decode_syncs(engine, steps, monkeypatch, before=add) == [1] * steps
    assert engine.counters["forks"] == len(prompts) - 1, "each added prompt forked in the counted steps"
    engine.check_integrity()


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_offload_and_restore_add_no_host_wait(model_dir, monkeypatch, async_batching):
    """Steps that offload sequences to the pinned CPU pool or restore them from it still wait once, for the
    sampled tokens: the copies queue on the copy stream, ordered with compute on the device (a pageable
    pool would make each copy wait)."""
    engine = Engine(EngineConfig(model=model_dir(), device="cuda", block_size=16, num_blocks=24, max_num_seqs=16,
                                 cpu_offload_gib=0.01, async_batching=async_batching))
    for i, prompt in enumerate(random_prompts(6, 512, (20, 40), seed=5)):
        params = SamplingParams(n=2, temperature=0.8, max_new_tokens=160, seed=i, ignore_eos=True)
        engine.add_request(prompt, params, prompt_index=i)
    offloader = engine.scheduler.offloader
    while offloader.restores == 0:  # the CPU pool's staging buffers are allocated
        engine.step()
    moved = offloader.offloads + offloader.restores
    assert decode_syncs(engine, 40, monkeypatch) == [1] * 40
    assert offloader.offloads + offloader.restores - moved >= 5, "too few copies to tell anything"
    engine.check_integrity()


def test_an_engine_dropped_in_a_cycle_does_not_break_the_next_capture(model_dir):
    """A dropped engine whose pinned CPU pool only the cyclic collector frees: its finalizer syncs the
    device, which mid-capture invalidated the next engine's graph (the tenth GPU session's first failure,
    torch 2.11). A threshold of 1 makes the collector run at nearly every allocation of the capture."""
    config = EngineConfig(model=model_dir(), device="cuda", num_blocks=24, max_num_seqs=4, cpu_offload_gib=0.01)
    dropped = Engine(config)
    dropped.me = dropped
    del dropped
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        engine = Engine(config)
    finally:
        gc.set_threshold(*thresholds)
    assert engine.runner.graphs.num_captured > 0 and engine.cpu_pool.num_blocks > 0
    run(engine, random_prompts(3, 512, (5, 30), seed=6), SamplingParams(n=2, temperature=0.8, max_new_tokens=24))
    engine.check_integrity()


def test_decode_graphs_are_captured_at_start(model_dir):
    """The default on CUDA: one graph per (batch bucket, KV bucket), captured before the first step."""
    engine = Engine(EngineConfig(model=model_dir(), device="cuda", max_num_seqs=40, max_model_len=1024))
    graphs = engine.runner.graphs
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 32, 40] and graphs.kv_sizes == [1024]
    assert sorted(graphs.graphs) == [(b, 1024) for b in graphs.batch_sizes]
    assert all(isinstance(entry.graph, torch.cuda.CUDAGraph) for entry in graphs.graphs.values())
    assert engine.runner.graph_capture_s > 0 and graphs.replays == 0


def test_captured_replays_equal_eager(model_dir):
    """float32 on the GPU: every decode step's captured replay equals its eager forward, writes only its
    own slots, and leaves the static buffers padded; across two KV buckets."""
    engine = make_engine(model_dir("qwen3", max_position_embeddings=2048), device="cuda", **ENGINE)
    checks = checking_replays(engine)
    run(engine, PROMPTS, PARAMS)
    assert checks and all(ok for _, _, ok in checks), [c for c in checks if not c[2]]
    assert {kv for (_, kv), _, _ in checks} == {1024, 2048}


def test_automatic_size_stays_within_the_cards_budget(model_dir):
    free, total = torch.cuda.mem_get_info()
    engine = Engine(EngineConfig(model=model_dir(), device="cuda", gpu_memory_utilization=0.3,
                                 max_model_len=1024))
    assert engine.runner.kv_cache.dtype == torch.bfloat16, "dtype auto on CUDA"
    assert engine.pool.num_blocks > 0
    assert torch.cuda.memory_allocated() <= 0.3 * total + (total - free)


def test_cpu_pool_is_pinned_to_its_size(model_dir):
    """Locked in whole pages, not rounded up to a power of two as torch's pinned allocator would; three
    layers make a bfloat16 block 1.5 pages, so the pool does not end on a page boundary."""
    engine = Engine(EngineConfig(model=model_dir(num_layers=3), device="cuda", num_blocks=64, cpu_offload_gib=0.01))
    pool = engine.cpu_pool
    (blocks,) = pool.blocks  # one K/V shape: one tensor
    assert blocks.is_pinned()
    assert pool.nbytes == pool.num_blocks * pool.bytes_per_block <= 0.01 * 2**30
    assert pool.nbytes % PAGE, "the pool must not end on a page boundary for this test to tell anything"
    assert blocks.untyped_storage().nbytes() == cdiv(pool.nbytes, PAGE) * PAGE, "locked in whole pages only"

"""Memory pressure: outputs are identical whether requests were offloaded, recomputed or never preempted."""

from __future__ import annotations

import functools

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import DEVICES, gib_per_block, make_engine, random_prompts, run
from workers.engine.batch import Batch
from workers.engine.block_pool import BlockKey, BlockPool, block_key
from workers.engine.block_table import BlockTables
from workers.engine.kv_cache import KvCache
from workers.engine.offload import CpuPool
from workers.engine.preemption import Offloader
from workers.engine.sequence import Group, Sequence, Status

BLOCK = 8


@pytest.fixture(scope="module")
def workload(model_dir):
    system = random_prompts(1, 512, (20, 20), seed=30)[0]
    prompts = [system + q for q in random_prompts(3, 512, (3, 17), seed=31)]
    params = [SamplingParams(n=8, temperature=0, max_new_tokens=40, ignore_eos=True),
              SamplingParams(n=8, temperature=1.0, top_p=0.95, max_new_tokens=40, seed=7, ignore_eos=True),
              SamplingParams(n=4, temperature=0.8, max_new_tokens=56, seed=8, ignore_eos=True)]
    path = model_dir("qwen3")
    roomy = functools.cache(lambda device: run(make_engine(path, device=device, block_size=BLOCK, num_blocks=1024),
                                               prompts, params))
    return path, prompts, params, roomy


def tight_blocks(prompts, params) -> int:
    """Barely more blocks than the longest single request needs (or its fork)."""
    longest = max(-(-(len(p) + q.max_new_tokens - 1) // BLOCK) for p, q in zip(prompts, params))
    at_fork = max(-(-len(p) // BLOCK) + q.n - 1 for p, q in zip(prompts, params))
    return max(longest, at_fork) + 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cpu_blocks, expect", [
    (4096, {"offloads", "restores"}),
    (0, {"recomputes"}),
    (6, {"offloads", "restores", "recomputes"}),
], ids=["offload", "recompute", "both"])
@pytest.mark.parametrize("device", DEVICES)
def test_outputs_identical_under_pressure(workload, cpu_blocks, expect, device):
    """Tokens and logprobs equal a roomy run on the same device (pinned CPU pool on CUDA)."""
    path, prompts, params, roomy_on = workload
    roomy = roomy_on(device)
    engine = make_engine(path, device=device, block_size=BLOCK, num_blocks=tight_blocks(prompts, params),
                         max_batch_tokens=64, cpu_offload_gib=cpu_blocks * gib_per_block(path, BLOCK))
    rows = run(engine, prompts, params)
    stats = engine.stats()
    for name in ("offloads", "restores", "recomputes"):
        assert (stats[name] > 0) == (name in expect), f"{name}={stats[name]} in {stats}"
    assert stats["cpu_blocks_used"] == 0, "the CPU pool is empty at the end"
    assert rows.keys() == roomy.keys()
    for key, want in roomy.items():
        assert rows[key]["token_ids"] == want["token_ids"], f"sample {key}"
        assert rows[key]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert sum(r["num_preemptions"] for r in rows.values()) >= stats["offloads"]
    assert all(r["num_preemptions"] == 0 for r in roomy.values())
    # every token sampled after a sample's first is a decode, the last of a recompute's chunk too
    assert stats["decode_tokens"] == sum(len(r["token_ids"]) - 1 for r in rows.values())


@pytest.mark.timeout(120)
def test_everyone_grows_at_once_no_livelock(model_dir):
    prompts = random_prompts(12, 512, (BLOCK, BLOCK), seed=32)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=3 * BLOCK, ignore_eos=True)
    path = model_dir("qwen3")
    engine = make_engine(path, block_size=BLOCK, num_blocks=8, max_batch_tokens=128,
                         cpu_offload_gib=16 * gib_per_block(path, BLOCK))
    rows = run(engine, prompts, params)
    assert len(rows) == 24 and all(len(r["token_ids"]) == 3 * BLOCK for r in rows.values())
    assert engine.stats()["offloads"] > 0


def test_a_prompt_in_prefill_is_not_held_back_by_newer_ones(model_dir):
    """A short request arrives every step and a 150-token prompt (prefilled in 64-token chunks) at step 10:
    once admitted, the long prompt holds its blocks, so its chunks shrink to the blocks there are rather
    than wait while each newcomer takes them (it used to sit 170 steps at 59 of 150 tokens)."""
    engine = make_engine(model_dir("qwen3"), block_size=4, num_blocks=48, max_batch_tokens=64)
    short = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    shorts = random_prompts(100, 512, (5, 5), seed=34)
    for step, prompt in enumerate(shorts):
        if step == 10:
            engine.add_request(random_prompts(1, 512, (150, 150), seed=35)[0],
                               SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True), request_id="long")
        engine.add_request(prompt, short)
        rows = engine.step()
        engine.check_integrity()
        if any(row["request_id"].startswith("long/") for row in rows):
            break
    assert step < 60, f"the long prompt finished only at step {step}"


def test_a_recomputing_context_is_not_the_next_victim_of_newer_requests(model_dir):
    """Two long prompts forked 8 ways on a cache far too small, a CPU pool too small for one sample: the
    running sequences stay in their requests' order through recomputes, restores and forks, so the newest
    are preempted and the oldest make progress. A recompute used to run last, and was preempted again before
    it made a token: 3 of 36 preemptions here, in 168 steps where 106 do."""
    path = model_dir("qwen3")
    engine = make_engine(path, block_size=4, num_blocks=100, max_batch_tokens=32,
                         cpu_offload_gib=4 * gib_per_block(path, 4))
    params = SamplingParams(n=8, temperature=1.0, seed=3, max_new_tokens=40, ignore_eos=True)
    for prompt in random_prompts(2, 512, (150, 150), seed=36):
        engine.add_request(prompt, params)
    scheduler, preempted = engine.scheduler, []  # (sequence, its tokens) at each preemption
    preempt = scheduler._preempt
    scheduler._preempt = lambda seq, batch: (preempted.append((seq, len(seq.token_ids))), preempt(seq, batch))
    while engine.has_unfinished():
        engine.step()
        order = [(seq.arrival, seq.sample_indices[0]) for seq in scheduler.running]
        assert order == sorted(order)
    last: dict[int, int] = {}
    fruitless = 0
    for seq, tokens in preempted:
        fruitless += last.get(id(seq)) == tokens
        last[id(seq)] = tokens
    assert engine.stats()["recomputes"] > 0 and fruitless == 0


def test_cpu_pool_is_capped_with_a_warning(model_dir):
    with pytest.warns(UserWarning, match="the CPU pool gets at most"):
        engine = make_engine(model_dir("qwen3"), cpu_offload_gib=1e6)
    assert engine.cpu_pool.num_blocks > 0


def test_abort_of_offloaded_request_frees_cpu_blocks(workload):
    path, prompts, params, _ = workload
    engine = make_engine(path, block_size=BLOCK, num_blocks=tight_blocks(prompts, params),
                         max_batch_tokens=64, cpu_offload_gib=4096 * gib_per_block(path, BLOCK))
    ids = [engine.add_request(p, q, prompt_index=i) for i, (p, q) in enumerate(zip(prompts, params))]
    while not engine.scheduler.offloader.offloaded:
        engine.step()
        engine.check_integrity()
    victim = engine.scheduler.offloader.offloaded[0].group.request_id
    engine.abort(victim)
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.stats()["cpu_blocks_used"] == 0 and victim in ids


def test_an_offload_copies_the_shared_blocks_the_prefix_cache_forgot(model_dir):
    """After `reset_prefix_cache` the prompt blocks two samples share have no key, so a restore could not find
    them on the device again: the offloaded sample copies them to the CPU too, and is restored, not recomputed."""
    path = model_dir("qwen3")
    engine = make_engine(path, block_size=4, num_blocks=6, cpu_offload_gib=8 * gib_per_block(path, 4))
    prompt = random_prompts(1, 512, (8, 8), seed=6)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_new_tokens=12, ignore_eos=True)
    engine.add_request(prompt, params)
    rows = engine.step() + engine.step()
    assert (engine.stats()["forks"], engine.stats()["offloads"]) == (1, 0)
    engine.reset_prefix_cache()
    while engine.has_unfinished():
        rows += engine.step()
        engine.check_integrity()
    stats = engine.stats()
    assert (stats["offloads"], stats["restores"], stats["recomputes"]) == (1, 1, 0)
    roomy = run(make_engine(path, block_size=4), [prompt], params)
    assert {r["sample_index"]: r["token_ids"] for r in rows} == {s: r["token_ids"] for (_, s), r in roomy.items()}


def offloader_of(num_blocks: int) -> Offloader:
    """An offloader over a pool of `num_blocks` blocks of 2 tokens, with a CPU pool of more blocks than that."""
    kv_cache = KvCache.of(torch.zeros(1, 2, num_blocks, 2, 1, 1))
    return Offloader(BlockPool(num_blocks, 2), BlockTables(4, 4, 2), CpuPool(kv_cache, gib=1e-6))


def decoding_sample(pool: BlockPool, tokens: list[int], blocks: list[int]) -> Sequence:
    """A running sample of `tokens` in `blocks` (one more owner of those already held), its last token still to
    compute and its complete blocks registered (a block whose twin is registered takes the twin's key)."""
    group = Group("r", 0, tokens[:4], SamplingParams(), 0, 0, frozenset(), 64, 1)
    seq = Sequence(group, [0], list(tokens), Status.RUNNING, num_computed_tokens=len(tokens) - 1)
    for block in blocks:
        if pool.ref_counts[block]:
            pool.share(block)
        else:
            pool.free.remove(block)
            pool.ref_counts[block] = 1
    seq.block_table = list(blocks)
    pool.register_blocks(seq)
    return seq


def test_an_offloaded_sample_gives_its_tail_blocks_to_eviction_first():
    """Two samples share their prompt's blocks 0 and 1. The one offloaded first copies only its own block: its
    restore needs the prompt's blocks still on the device. The other then frees all of its blocks to the cache
    from its last back, so evictions take its own block before the prompt's: the first stays restorable."""
    offloader = offloader_of(6)
    pool = offloader.pool
    first = decoding_sample(pool, [11, 12, 13, 14, 21, 22, 23], [0, 1, 2])
    second = decoding_sample(pool, [11, 12, 13, 14, 31, 32, 33], [0, 1, 3])
    assert offloader.offload(second, Batch()) and offloader.offload(first, Batch())
    assert second.cpu_blocks[:2] == [-1, -1] and min(first.cpu_blocks) >= 0
    pool.allocate(4)  # the 2 free blocks, then the 2 oldest cached: blocks 3 and 2
    assert offloader.plan_restore(second) == ([0, 1, None], 4)


def test_a_restore_that_takes_exactly_the_spare_blocks_happens_now():
    """An offloaded sample whose restore consumes exactly the spare device blocks is restored in this step,
    not one later; one block fewer and it waits."""
    offloader = offloader_of(6)
    seq = decoding_sample(offloader.pool, [11, 12, 13, 14, 21, 22, 23], [0, 1, 2])
    assert offloader.offload(seq, Batch())
    _, consumed = offloader.plan_restore(seq)
    assert offloader.restore_fitting(Batch(), consumed - 1, room=1) == ([], [])
    assert offloader.restore_fitting(Batch(), consumed, room=1) == ([seq], [])


def test_restore_keeps_the_cached_blocks_it_reuses():
    """Restoring with an empty free list: the block copied back in may evict only cached blocks the
    sequence does not reuse (here its own blocks 1 and 2 are the oldest cached)."""
    offloader = offloader_of(7)
    pool = offloader.pool
    tokens = [11, 12, 13, 14, 15, 16, 17]
    group = Group("r", 0, tokens[:3], SamplingParams(), 0, 0, frozenset(), 64, 1)
    seq = Sequence(group, [0], list(tokens), Status.RUNNING, num_computed_tokens=6)
    seq.block_table = pool.allocate(3)
    for i in range(3):
        seq.block_hashes.append(block_key(seq.block_hashes[-1] if i else 0, tokens[2 * i:2 * i + 2]))
    for i in (1, 2):  # block 0 stays unregistered (another block held its hash when it completed)
        pool.register(seq.block_table[i], seq.block_hashes[i])
    assert offloader.offload(seq, Batch())
    others = pool.allocate(5)
    for i, block in enumerate(others[:2]):
        pool.register(block, BlockKey(1000 + i, 0, (i, i)))
    pool.release(others[:2])  # cached after blocks 2 and 1: evicted later
    plan, _ = offloader.plan_restore(seq)
    assert plan == [None, 1, 2] and not pool.free
    batch = Batch()
    offloader.restore(seq, plan, batch)
    assert seq.block_table == [others[0], 1, 2] and batch.restore_copies == [(0, others[0])]
    pool.check_integrity([seq.block_table, others[2:]])

"""The paged KV cache of a model whose layers differ: one tensor per K/V shape, shared layers aliased,
every block copy, offload and restore reaching every tensor."""

from __future__ import annotations

import os

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import ON_GPU, gib_per_block, make_engine, random_prompts, run
from workers.engine.kv_cache import KvCache, KvLayout
from workers.engine.offload import CpuPool

BLOCK = 8
# Their float32 MoE experts wait on the host, so on a GPU their decode graphs are refused (test_model_coverage
# captures them in bfloat16).
FLOAT32_MOE = ("mimo_v2_flash", "deepseek_v3")
# Windowed layers of 2 heads x 8, global ones of 1 head x 16; layers 4 and 5 reuse 2's and 3's K/V.
MIXED = KvLayout(shapes=((2, 8), (1, 16)) * 3, owners=(0, 1, 2, 3, 2, 3), windows=(12, None) * 3)


def test_each_shape_gets_a_tensor_and_a_layer_reusing_kv_takes_no_memory(zoo_dir):
    runner = make_engine(zoo_dir("gemma4_text"), block_size=BLOCK, num_blocks=16).runner
    assert runner.layout == MIXED
    cache = runner.kv_cache
    assert [tuple(t.shape) for t in cache.tensors] == [(2, 2, 16, BLOCK, 2, 8), (2, 2, 16, BLOCK, 1, 16)]
    assert cache.layers[4].data_ptr() == cache.layers[2].data_ptr() != cache.layers[0].data_ptr()
    assert cache.stores == [True] * 4 + [False] * 2, "a layer reusing K/V does not store them again"
    assert runner.bytes_per_block == cache.nbytes // 16 == 4 * 2 * BLOCK * 16 * 4


@pytest.mark.parametrize("layout", [MIXED, MIXED._replace(values_are_keys=frozenset({1, 3}))],
                         ids=["two-planes", "values-are-keys"])
def test_block_copies_gathers_and_scatters_reach_every_layer(layout):
    """Also for layers storing one plane that serves as K and V (latent attention)."""
    cache = KvCache.allocate(layout, 6, 4, torch.float32, "cpu")
    assert cache.nbytes == 6 * layout.bytes_per_block(4, torch.float32)
    assert [t.shape[1] for t in cache.tensors] == [2, 1 if layout.values_are_keys else 2]
    for t in cache.tensors:
        t.normal_()
    cache.copy_blocks(torch.tensor([1, 2]), torch.tensor([4, 5]))
    for layer in cache.layers:
        assert torch.equal(layer[:, 4], layer[:, 1]) and torch.equal(layer[:, 5], layer[:, 2])
    before = [layer.clone() for layer in cache.layers]
    pool = CpuPool(cache, gib=3 * layout.bytes_per_block(4, torch.float32) / 2**30)
    assert pool.num_blocks == 3
    pool.copy_to_cpu([(0, 2), (3, 0)])
    for t in cache.tensors:
        t.zero_()
    pool.copy_to_device([(2, 1), (0, 5)])
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer[:, 1], old[:, 0]) and torch.equal(layer[:, 5], old[:, 3])
        assert not layer[:, 0].any()


@pytest.mark.parametrize("name", ["gemma4_text", "deepseek_v3"])
@pytest.mark.parametrize("cpu_blocks", [4096, 0], ids=["offload", "recompute"])
def test_samples_of_a_mixed_layout_model_do_not_depend_on_memory_pressure(zoo_dir, cpu_blocks, name):
    """Gemma 4 (K/V of two shapes, shared layers) and DeepSeek-V3 (one latent plane per layer) forked into
    samples, offloaded and restored (or recomputed): the samples of a roomy cache."""
    path = zoo_dir(name)
    system = random_prompts(1, 128, (20, 20), seed=40)[0]
    prompts = [system + q for q in random_prompts(3, 128, (3, 17), seed=41)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=30, seed=5, ignore_eos=True)
    roomy = run(make_engine(path, block_size=BLOCK, num_blocks=512), prompts, params)
    engine = make_engine(path, block_size=BLOCK, num_blocks=12, max_batch_tokens=64,
                         cpu_offload_gib=cpu_blocks * gib_per_block(path, BLOCK))
    rows = run(engine, prompts, params)
    stats = engine.stats()
    assert (stats["offloads"] > 0) == (cpu_blocks > 0) and stats["offloads"] + stats["recomputes"] > 0, stats
    assert stats["forks"] > 0 and rows.keys() == roomy.keys()
    for key, want in roomy.items():
        assert rows[key]["token_ids"] == want["token_ids"], f"sample {key}"
        assert rows[key]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


@pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton needs CUDA or its interpreter")
@pytest.mark.parametrize("name", ["gemma4_text", "mimo_v2_flash", "deepseek_v3"])
def test_triton_kernels_serve_layers_of_other_shapes(zoo_dir, name):
    """Per-layer head sizes and counts (Gemma 4; MiMo-V2-Flash, whose values are also padded to its keys'
    head size of 12 and whose heads have attention sinks; DeepSeek-V3's latent, one KV head whose values
    are its keys) through the Triton kernels, decode graphs (captured on a GPU, but for float32 MoE)
    included: the torch backend's tokens."""
    pytest.importorskip("triton")
    path = zoo_dir(name)
    prompts = random_prompts(4, 128, (5, 30), seed=42)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, ignore_eos=True)
    config = dict(block_size=16, max_batch_tokens=32, device="cuda" if ON_GPU else "cpu")
    want = run(make_engine(path, attention_backend="torch", **config), prompts, params)
    graphs = not (ON_GPU and name in FLOAT32_MOE)
    engine = make_engine(path, attention_backend="triton", cuda_graphs=(False, graphs), **config)
    got = run(engine, prompts, params)
    assert engine.runner.graphs.replays > 0 if graphs else engine.runner.graphs is None
    for key in want:
        assert got[key]["token_ids"] == want[key]["token_ids"]
        assert got[key]["logprobs"] == pytest.approx(want[key]["logprobs"], abs=1e-4)

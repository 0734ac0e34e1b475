"""Multi-head latent attention cached as its latent (workers/engine/latent.py): one plane of
`kv_lora_rank + rope` numbers per token and layer, attended with absorbed queries, exact against
transformers (test_model_coverage runs every MLA family; here what is particular to the latent)."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine, random_prompts, run
from tests.test_model_coverage import assert_exact
from workers.engine import latent

MODEL = "deepseek_v3"  # tests/model_zoo.py: 4 layers, 4 heads, kv_lora_rank 16, rope 4, nope 8, values 8
LAYERS, RANK, ROPE, BLOCK = 4, 16, 4, 8


def test_the_cache_holds_each_tokens_latent_once(zoo_dir):
    runner = make_engine(zoo_dir(MODEL), block_size=BLOCK, num_blocks=16).runner
    assert runner.layout.values_are_keys == frozenset(range(LAYERS))
    assert [tuple(t.shape) for t in runner.kv_cache.tensors] == [(LAYERS, 1, 16, BLOCK, 1, RANK + ROPE)]
    keys, values = runner.kv_cache.layers[2]
    assert keys.data_ptr() == values.data_ptr(), "values are the keys' plane, not a copy"
    # expanded, each token would take 4 heads x (8 + 4) keys and as many (padded) values per layer
    assert runner.bytes_per_block == LAYERS * BLOCK * (RANK + ROPE) * 4 == runner.kv_cache.nbytes // 16


def test_a_layer_that_cannot_absorb_keeps_expanded_keys_and_values_exactly(zoo_dir, monkeypatch):
    """A `kv_b_proj` that is not a plain bias-free Linear (a quantized one) is never absorbed: its layer
    caches the expanded K and zero-padded V, as exact as the latent."""
    monkeypatch.setattr(latent, "_is_latent_attention", lambda module: False)
    engine = assert_exact(zoo_dir(MODEL))
    assert engine.runner.layout.values_are_keys == frozenset()
    assert engine.runner.kv_cache.tensors[0].shape[1] == 2


def test_a_weight_update_reaches_the_absorbed_projections(zoo_dir):
    """The absorbed W_UK and W_UV are views of `kv_b_proj`'s weight: an engine updated to new weights
    samples what an engine built with them samples."""
    prompts = random_prompts(3, 128, (5, 20), seed=7)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=8, ignore_eos=True)
    updated = make_engine(zoo_dir(MODEL))
    before = run(updated, prompts, params)
    updated.update_weights(zoo_dir(MODEL, seed=1), version=1)
    got, want = run(updated, prompts, params), run(make_engine(zoo_dir(MODEL, seed=1)), prompts, params)
    assert any(got[key]["token_ids"] != before[key]["token_ids"] for key in before)
    for key in want:
        assert got[key]["token_ids"] == want[key]["token_ids"], f"sample {key}"
        assert got[key]["logprobs"] == pytest.approx(want[key]["logprobs"], abs=1e-5)


def test_absorbed_attention_equals_attention_over_expanded_keys_and_values():
    """One head's scores and output from the latent equal those of the keys and values `kv_b_proj`
    expands it into."""
    torch.manual_seed(0)
    heads, nope, v_dim, tokens = 3, 8, 6, 5
    module = torch.nn.Module()
    module.kv_b_proj = torch.nn.Linear(RANK, heads * (nope + v_dim), bias=False)
    module.kv_lora_rank, module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim = RANK, nope, ROPE, v_dim
    c, k_rot, q = torch.randn(tokens, RANK), torch.randn(tokens, ROPE), torch.randn(1, heads, nope + ROPE)
    expanded = module.kv_b_proj(c).view(tokens, heads, nope + v_dim)
    keys = torch.cat((expanded[..., :nope], k_rot[:, None].expand(-1, heads, -1)), -1)
    probs = torch.softmax(torch.einsum("qhd,thd->hqt", q, keys), -1)
    want = torch.einsum("hqt,thv->qhv", probs, expanded[..., nope:])
    cached = torch.cat((c, k_rot), -1)
    absorbed = latent.absorb_query(module, q)
    latent_probs = torch.softmax(torch.einsum("qhd,td->hqt", absorbed, cached), -1)
    torch.testing.assert_close(latent_probs, probs)
    got = latent.expand_output(module, torch.einsum("hqt,td->qhd", latent_probs, c))
    torch.testing.assert_close(got, want)

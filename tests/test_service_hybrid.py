"""Qwen3.5 through the service, as an RL loop runs it: two CPU workers serve its vision-language checkpoint
text-only, and a trainer's update with the whole model's state dict (vision tower included) gives the
samples of an engine built from the new weights."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import transformers

import rollout
from rollout import SamplingParams
from tests.conftest import make_engine, random_prompts

PARAMS = dict(n=3, temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def policies(zoo_dir):
    """Two checkpoints of the Qwen3.5 vision-language model with different random weights."""
    return zoo_dir("qwen3_5"), zoo_dir("qwen3_5", seed=1)


@pytest.fixture(scope="module")
def service(policies):
    rollout.init(model=policies[0], num_workers=2, flush_rows=4, flush_delay_s=0.02, max_num_seqs=8,
                 num_blocks=64, object_store_memory_gib=0.5)
    yield
    rollout.shutdown()


def assert_same_samples(served: pa.Table, local: pa.Table) -> None:
    assert served.column("token_ids").to_pylist() == local.column("token_ids").to_pylist()
    for a, b in zip(served.column("logprobs").to_pylist(), local.column("logprobs").to_pylist()):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_hybrid_rollout_and_a_trainers_weight_update_through_the_service(policies, service):
    prompts = random_prompts(4, 128, (5, 30), seed=11)
    before = rollout.sample(prompts, **PARAMS).to_table()
    assert_same_samples(before, make_engine(policies[0]).generate(prompts, SamplingParams(**PARAMS)))
    trainer = transformers.AutoModelForImageTextToText.from_pretrained(policies[1], dtype=torch.float32)
    state = trainer.state_dict()
    assert any(".visual." in name for name in state)
    rollout.update_weights(state, 1)
    after = rollout.sample(prompts, **PARAMS).to_table()
    assert_same_samples(after, make_engine(policies[1]).generate(prompts, SamplingParams(**PARAMS)))
    assert after.column("token_ids").to_pylist() != before.column("token_ids").to_pylist()
    assert set(after.column("policy_version").to_pylist()) == {1}

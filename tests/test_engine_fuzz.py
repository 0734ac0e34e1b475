"""Random interleavings of requests, aborts, weight updates and prefix-cache resets on a tight KV cache.

Updates alternate between two policies (random models of two seeds). Whatever the order and the
engine's sizes, block accounting balances after every step, every sample ends exactly once, and each
one equals its run alone in a roomy engine under the policy of its first token (tokens, finish reason,
logprobs to 1e-4). A sample cut short by an abort equals a prefix of that run; one that an update in
mode "continue" switched to the other policy (its prompt's KV or its tokens computed partly under each)
equals it up to the switch.
"""

from __future__ import annotations

import functools
from typing import Mapping

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout import SamplingParams
from tests.conftest import assert_nothing_leaked, gib_per_block, make_engine, random_prompts, run
from tests.test_async_batching import STOP
from workers.engine.weights import load_source

BLOCK = 4
SYSTEM = random_prompts(1, 512, (13, 13), seed=50)[0]
PROMPTS = [SYSTEM + q for q in random_prompts(4, 512, (1, 9), seed=51)] + random_prompts(2, 512, (2, 30), seed=52)
PARAMS = [SamplingParams(n=3, temperature=0, max_new_tokens=14, ignore_eos=True, return_token_versions=True),
          SamplingParams(n=4, temperature=1.0, max_new_tokens=22, seed=3, stop_token_ids=STOP,
                         return_token_versions=True),
          SamplingParams(n=1, temperature=0.7, top_k=20, max_new_tokens=9, seed=4, return_token_versions=True),
          SamplingParams(n=2, temperature=0.9, top_p=0.9, max_new_tokens=30, seed=5, ignore_eos=True,
                         return_token_versions=True, logprobs_mode="raw")]
# Raw logprobs under top-p: a token whose cumulative probability lies within float rounding of top_p is
# kept in one batch shape and dropped in another, which moves processed logprobs by its mass (seen: 1e-3).
# Every (prompt, params) pair a drawn request may be; the same one twice is two requests with equal samples.
CANDIDATES = [(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS)] + [(PROMPTS[0], PARAMS[1])]
NEEDED = max(-(-(len(p) + q.max_new_tokens) // BLOCK) + q.n for p, q in CANDIDATES)

# One event per drawn tuple: (steps to run before it, what, which request it targets)
events = st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["add", "add", "add", "abort", "update", "reset"]),
                            st.integers(0, 100)), min_size=1, max_size=14)
configs = st.fixed_dictionaries({
    "num_blocks": st.integers(NEEDED, NEEDED + 24), "cpu_blocks": st.sampled_from([0, 6, 200]),
    "max_batch_tokens": st.sampled_from([8, 32, 256]), "max_num_seqs": st.sampled_from([4, 8, 64]),
    "async_batching": st.booleans(), "cuda_graphs": st.sampled_from([None, (False, True)]),
    "enable_prefix_caching": st.booleans()})


@functools.cache
def alone(path: str, index: int) -> dict[int, dict]:
    """Rows by sample index of candidate `index`, run alone in a roomy engine."""
    prompt, params = CANDIDATES[index]
    rows = run(make_engine(path, block_size=BLOCK, num_blocks=512), [prompt], params)
    return {sample: row for (_, sample), row in rows.items()}


@functools.cache
def weights(path: str) -> Mapping[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`, as an update sends them (the tiny models are float32, their
    embeddings untied)."""
    return load_source(path)


@functools.cache
def loaded(path: str) -> Mapping[str, torch.Tensor]:
    """The state dict of an engine that loaded `path`: its tensors under the model's names (transformers fuses
    a mixture of experts' per-expert checkpoint tensors on load)."""
    return make_engine(path, block_size=BLOCK, num_blocks=64).state_dict()


class Driver:
    """Applies events to one engine, stepping it and collecting every row by request id. Policy version
    v is the model at `paths[v % 2]`."""

    def __init__(self, paths: tuple[str, str], config: dict) -> None:
        cpu_gib = config.pop("cpu_blocks") * gib_per_block(paths[0], BLOCK)
        self.engine = make_engine(paths[0], block_size=BLOCK, check_integrity=True, cpu_offload_gib=cpu_gib,
                                  **config)
        self.policies = [weights(path) for path in paths]
        self.added: list[tuple[str, int, list[int]]] = []  # (request id, candidate index, sample indices)
        self.switched: dict[str, int] = {}  # request id -> the first version it continued under, once started
        self.rows: dict[str, dict] = {}

    def collect(self, rows: list[dict]) -> None:
        for row in rows:
            assert row["request_id"] not in self.rows, f"{row['request_id']} ended twice"
            self.rows[row["request_id"]] = row

    def step(self) -> None:
        self.collect(self.engine.step())
        self.engine.check_integrity()

    def apply(self, what: str, target: int) -> None:
        engine = self.engine
        if what == "add":
            index = target % len(CANDIDATES)
            prompt, params = CANDIDATES[index]
            samples = list(range(params.n))[target % 2::1 + target % 2]  # all, or the odd ones (a retry's subset)
            rid = engine.add_request(prompt, params, prompt_index=len(self.added), sample_indices=samples or None)
            self.added.append((rid, index, samples or list(range(params.n))))
        elif what == "abort" and self.added:
            self.collect(engine.abort(self.added[target % len(self.added)][0]))
        elif what == "update":
            mode = ("continue", "abort", "finish")[target % 3]
            version = engine.policy_version + 1
            if mode == "continue":
                for seq in engine.scheduler.sequences():
                    if seq.started:
                        self.switched.setdefault(seq.group.request_id, version)
            self.collect(engine.update_weights(self.policies[version % 2], version, mode))
        elif what == "reset":
            engine.reset_prefix_cache()
        engine.check_integrity()


def check_rows(paths: tuple[str, str], driver: Driver) -> None:
    """Every sample of every added request ended once, equal to its solo run under its first policy up to
    a switch; and whole, finish reason included, unless aborted or switched."""
    assert driver.rows.keys() == {f"{rid}/{s}" for rid, _, samples in driver.added for s in samples}
    for rid, index, samples in driver.added:
        switch = driver.switched.get(rid)
        for sample in samples:
            row = driver.rows[f"{rid}/{sample}"]
            first, versions = row["first_policy_version"], row["token_policy_versions"]
            want = alone(paths[first % 2], index)[sample]
            n = len(versions) if switch is None else sum(v < switch for v in versions)
            assert versions[:n] == [first] * n and versions == sorted(versions), f"{rid}/{sample}: {versions}"
            assert row["token_ids"][:n] == want["token_ids"][:n], f"{rid}/{sample} of candidate {index}"
            assert row["logprobs"][:n] == pytest.approx(want["logprobs"][:n], abs=1e-4)
            if row["finish_reason"] != "abort" and switch is None:
                assert (row["token_ids"], row["finish_reason"]) == (want["token_ids"], want["finish_reason"])


def drive(paths: tuple[str, str], config: dict, schedule: list[tuple[int, str, int]]) -> None:
    """Apply `schedule` to an engine of `config`, step it to the end and check every sample and the weights."""
    driver = Driver(paths, dict(config))
    for steps, what, target in schedule:
        for _ in range(steps):
            if driver.engine.has_unfinished():
                driver.step()
        driver.apply(what, target)
    while driver.engine.has_unfinished():
        driver.step()
    assert_nothing_leaked(driver.engine)
    assert driver.engine.stats()["cpu_blocks_used"] == 0
    check_rows(paths, driver)
    want = loaded(paths[driver.engine.policy_version % 2])
    torch.testing.assert_close(driver.engine.state_dict(), want, rtol=0, atol=0)


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(["qwen3", "mistral", "gemma2"]), config=configs, schedule=events)
def test_random_interleavings_equal_solo_runs(model_dir, arch, config, schedule):
    """Also on sliding-window models (windows of 24 and 16 tokens; gemma2 with its logit softcap)."""
    drive((model_dir(arch), model_dir(arch, seed=1)), config, schedule)


@pytest.mark.timeout(300)
@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["qwen3_5_text", "mamba2", "gpt_oss"]), config=configs, schedule=events)
def test_random_interleavings_keep_per_sequence_state(zoo_dir, name, config, schedule):
    """The same on models with a state per sequence, kept in slots that forks copy, preemption offloads and
    rows reuse: a Gated DeltaNet hybrid, Mamba-2 (no attention) and gpt-oss (windowed layers in rings)."""
    drive((zoo_dir(name, vocab_size=512), zoo_dir(name, seed=1, vocab_size=512)), config, schedule)


@pytest.mark.timeout(300)
@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["deepseek_v3", "minicpm3"]), config=configs, schedule=events)
def test_random_interleavings_on_latent_attention(zoo_dir, name, config, schedule):
    """The same where the cache holds each token's latent and the attention absorbs `kv_b_proj`, which every
    update must reach: DeepSeek-V3 (experts fused on load, YaRN) and MiniCPM3 (dense)."""
    drive((zoo_dir(name, vocab_size=512), zoo_dir(name, seed=1, vocab_size=512)), config, schedule)

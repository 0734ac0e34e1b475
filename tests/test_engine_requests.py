"""Prefix caching, stop conditions, abort and bad input."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import transformers

from rollout import SamplingParams
from rollout.config import EngineConfig, convert
from tests.conftest import assert_nothing_leaked, hf_greedy, hf_model, make_engine, random_prompts, run
from tests.model_zoo import build_zoo_model
from workers.engine import Engine, block_pool, pipeline


@pytest.fixture(scope="module")
def qwen3(model_dir):
    return model_dir("qwen3")


GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def test_shared_system_prompt_is_computed_once(qwen3):
    system = random_prompts(1, 512, (48, 48), seed=10)[0]
    questions = random_prompts(4, 512, (5, 20), seed=11)
    prompts = [system + q for q in questions]
    engine = make_engine(qwen3, block_size=16)
    first = run(engine, prompts[:1], GREEDY)
    rest = run(engine, prompts[1:], GREEDY)
    stats = engine.stats()
    assert stats["cached_prefix_tokens"] == 3 * 48
    assert stats["prefill_tokens"] == sum(map(len, prompts)) - 3 * 48
    plain = run(make_engine(qwen3, enable_prefix_caching=False), prompts, GREEDY)
    assert first[(0, 0)]["token_ids"] == plain[(0, 0)]["token_ids"]
    for i in range(3):
        assert rest[(i, 0)]["token_ids"] == plain[(i + 1, 0)]["token_ids"]


def test_identical_prompt_reuses_all_but_last_token(qwen3):
    prompt = random_prompts(1, 512, (32, 32), seed=12)[0]
    engine = make_engine(qwen3, block_size=16)
    a = run(engine, [prompt], GREEDY)
    b = run(engine, [prompt], GREEDY)
    assert engine.stats()["cached_prefix_tokens"] == 16
    assert a[(0, 0)]["token_ids"] == b[(0, 0)]["token_ids"]


def test_a_colliding_block_hash_never_serves_kv_of_another_prefix(qwen3, monkeypatch):
    """Block `c` is made to hash alike after any parent: `b + c + tail` may reuse the cached `b` but must not
    be served the KV of `c` computed after `a`, because a hit is checked against its parent's hash as well as
    its tokens."""
    a, b, c, d, tail = random_prompts(5, 512, (16, 16), seed=14)
    real = block_pool.hash_block
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, tokens: real(0 if tokens == c else parent, tokens))
    engine = make_engine(qwen3, block_size=16)
    run(engine, [a + c + tail, b + d + tail], GREEDY)
    row = run(engine, [b + c + tail], GREEDY)[(0, 0)]
    assert engine.stats()["cached_prefix_tokens"] == 16
    assert row["token_ids"] == hf_greedy(qwen3, b + c + tail, new=12)


def test_reset_prefix_cache(qwen3):
    prompt = random_prompts(1, 512, (40, 40), seed=13)[0]
    engine = make_engine(qwen3)
    run(engine, [prompt], GREEDY)
    assert engine.stats()["blocks_cached"] > 0
    engine.reset_prefix_cache()
    engine.check_integrity()
    assert engine.stats()["blocks_cached"] == 0
    run(engine, [prompt], GREEDY)
    assert engine.stats()["cached_prefix_tokens"] == 0


def test_stop_conditions(qwen3):
    engine = make_engine(qwen3, max_model_len=30)
    prompt = random_prompts(1, 512, (10, 10), seed=14)[0]
    free = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[(0, 0)]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 8
    stop_at = free["token_ids"][3]
    stopped = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[stop_at]))[(0, 0)]
    first = free["token_ids"].index(stop_at)
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == free["token_ids"][: first + 1]
    capped = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True))[(0, 0)]
    assert capped["finish_reason"] == "length" and len(capped["token_ids"]) == 30 - 10


def test_max_model_len_past_the_models_limit_is_refused(qwen3, monkeypatch):
    """As in vLLM: a length the model's positions do not reach is an error at construction, not lowered."""
    assert make_engine(qwen3).max_model_len == 1024 and make_engine(qwen3, max_model_len=1024).max_model_len == 1024
    with monkeypatch.context() as patch, pytest.raises(
            ValueError, match=r"max_model_len=1025 is longer than the model's max_position_embeddings=1024"):
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # refused before any weight loads
        make_engine(qwen3, max_model_len=1025)


def test_a_request_keeps_its_own_params(qwen3):
    """A caller may change and reuse its SamplingParams right after `add_request`: the queued request keeps what
    it was given (vLLM copies them too)."""
    prompt = random_prompts(1, 512, (7, 7), seed=21)[0]
    sampled = dict(temperature=1.0, seed=7, max_new_tokens=8, ignore_eos=True)
    want = run(make_engine(qwen3), [prompt], SamplingParams(**sampled))[(0, 0)]
    engine = make_engine(qwen3)
    params = SamplingParams(**sampled)
    engine.add_request(prompt, params)
    params.temperature, params.n, params.logprobs_mode = 0.0, 2, "raw"
    params.stop_token_ids.append(want["token_ids"][1])
    got = run(engine, [], [])
    assert list(got) == [(0, 0)] and got[(0, 0)]["token_ids"] == want["token_ids"]
    assert got[(0, 0)]["logprobs"] == want["logprobs"]


def test_generation_config_processors_are_named_and_not_applied(qwen3, tmp_path, caplog):
    """`generate` applies a checkpoint's repetition_penalty or suppress_tokens even when greedy; the engine
    samples the model's own distribution (what a trainer's logprobs are of) and names what it leaves out."""
    path = tmp_path / "model"
    shutil.copytree(qwen3, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(
        {**config, "repetition_penalty": 1.3, "suppress_tokens": [7, 9], "no_repeat_ngram_size": 0}))
    prompts = random_prompts(3, 512, (4, 12), seed=22)
    with caplog.at_level(logging.WARNING, logger="workers.engine.generation_config"):
        rows = run(make_engine(str(path)), prompts, GREEDY)
    assert "sets repetition_penalty=1.3, suppress_tokens=[7, 9], which" in caplog.text
    want = run(make_engine(qwen3), prompts, GREEDY)
    assert all(rows[key]["token_ids"] == want[key]["token_ids"] for key in want)
    assert any(hf_greedy(str(path), prompt, 12) != rows[(i, 0)]["token_ids"] for i, prompt in enumerate(prompts))


def test_eos_of_a_vision_language_config_without_a_generation_eos(tmp_path):
    """A checkpoint whose generation_config.json names no EOS (sampling defaults only) ends samples on its
    config's EOS, which a vision-language config (Gemma 3) keeps in its text config alone."""
    path = build_zoo_model("gemma3", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config.pop("eos_token_id", None)
    config["text_config"]["eos_token_id"] = 5
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 0.95}))
    assert make_engine(path).eos_token_ids == {5}


def test_eos_stops_unless_ignored(qwen3):
    engine = make_engine(qwen3)
    eos = next(iter(engine.eos_token_ids))
    prompts = random_prompts(16, 512, (3, 20), seed=15)
    free = run(engine, prompts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    hits = [i for i in range(16) if eos in free[(i, 0)]["token_ids"]]
    assert hits, "no greedy continuation meets eos; pick other prompts"
    rows = run(engine, prompts, SamplingParams(temperature=0, max_new_tokens=40))
    for i in range(16):
        tokens = free[(i, 0)]["token_ids"]
        if i in hits:
            assert rows[(i, 0)]["finish_reason"] == "stop"
            assert rows[(i, 0)]["token_ids"] == tokens[: tokens.index(eos) + 1]
        else:
            assert rows[(i, 0)]["token_ids"] == tokens



def test_every_eos_of_the_generation_config_stops(qwen3, tmp_path, caplog):
    """A generation config with several eos ids (as Llama 3 Instruct's) stops on whichever comes first, as
    `generate` does; the tokenizer's EOS, no longer among them, stops nothing, which the log says."""
    prompt = random_prompts(1, 512, (6, 6), seed=16)[0]
    with caplog.at_level(logging.WARNING, logger="workers.engine.generation_config"):
        free = run(make_engine(qwen3), [prompt], GREEDY)[(0, 0)]["token_ids"]
    assert "ends no sample" not in caplog.text
    path = shutil.copytree(qwen3, tmp_path / "model")
    config = transformers.GenerationConfig.from_pretrained(path)
    config.eos_token_id = [free[5], free[2]]
    config.save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="workers.engine.generation_config"):
        engine = make_engine(str(path))
    eos = engine.tokenizer.eos_token_id
    assert f"(id {eos}) ends no sample" in caplog.text and f"stop_token_ids=[{eos}]" in caplog.text
    row = run(engine, [prompt], SamplingParams(temperature=0, max_new_tokens=12))[(0, 0)]
    want = hf_model(str(path)).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 6:]
    assert row["finish_reason"] == "stop" and row["token_ids"] == free[:3] == want.tolist()

def test_abort_frees_blocks_and_returns_partial_rows(qwen3):
    engine = make_engine(qwen3)
    params = SamplingParams(n=3, max_new_tokens=50, ignore_eos=True)
    rid = engine.add_request(random_prompts(1, 512, (20, 20))[0], params)
    for _ in range(3):
        engine.step()
    rows = engine.abort(rid)
    engine.check_integrity()
    assert sorted(r["sample_index"] for r in rows) == [0, 1, 2]
    assert all(r["finish_reason"] == "abort" and len(r["token_ids"]) == 3 for r in rows)
    assert not engine.has_unfinished()
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_batching", [False, True])
def test_abort_of_many_requests_at_once(qwen3, async_batching):
    """`abort(*ids)` ends running and waiting requests in one pass (a closed call's thousands); the others
    go on, exact, and every block is back."""
    engine = make_engine(qwen3, max_num_seqs=2, async_batching=async_batching)
    prompts = random_prompts(5, 512, (6, 14), seed=31)
    ids = [engine.add_request(p, GREEDY, prompt_index=i) for i, p in enumerate(prompts)]
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert [s.group.request_id for s in engine.scheduler.running] == ids[:2]
    with pytest.raises(TypeError, match=r"got \[.*unpack a list: abort\(\*ids\)"):
        engine.abort(ids[1:])
    assert engine.abort() == []
    rows = engine.abort(ids[1], ids[3], ids[4], "unknown")
    engine.check_integrity()
    assert sorted(r["prompt_index"] for r in rows) == [1, 3, 4]
    assert all(r["finish_reason"] == "abort" for r in rows) and len(rows[0]["token_ids"]) == 3
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
        engine.check_integrity()
    assert {r["prompt_index"]: r["token_ids"] for r in rest} == {i: hf_greedy(qwen3, prompts[i], 12) for i in (0, 2)}
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("interrupt_at", [1, 3, 10])
@pytest.mark.parametrize("where", ["step", "wait"])
def test_an_interrupted_generate_leaves_nothing_for_the_next(qwen3, monkeypatch, async_batching, interrupt_at, where):
    """Ctrl-C (or a failed step) inside `generate`, between steps or while a step's tokens are awaited,
    aborts its requests: the next call returns its own rows only, and every block is back."""
    engine = make_engine(qwen3, async_batching=async_batching)
    prompts, params = random_prompts(3, 512, (4, 12), seed=23), SamplingParams(n=2, max_new_tokens=12, ignore_eos=True)
    owner = engine if where == "step" else pipeline.Sampled
    original, calls = getattr(owner, where), []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(owner, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert_nothing_leaked(engine)
    table = engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))
    assert table.num_rows == 1 and table.column("prompt_index").to_pylist() == [0]


def test_sample_indices_subset(qwen3):
    prompt = random_prompts(1, 512, (12, 12), seed=16)[0]
    params = SamplingParams(n=6, max_new_tokens=10, seed=9, ignore_eos=True)
    full = run(make_engine(qwen3), [prompt], params)
    engine = make_engine(qwen3)
    engine.add_request(prompt, params, sample_indices=np.array([4, 1]))  # any integer sequence
    rows = {}
    while engine.has_unfinished():
        rows.update((r["sample_index"], r) for r in engine.step())
    assert sorted(rows) == [1, 4]
    assert rows[4]["token_ids"] == full[(0, 4)]["token_ids"]


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt 0 is empty"),
    ([1, 2, 512], SamplingParams(), "token id 512 outside"),
    ([1, -3], SamplingParams(), "token id -3 outside"),
    ([5] * 1024, SamplingParams(), "1024 tokens"),
    ([5, 6], SamplingParams(n=2), None),
    ([5, 2.0], SamplingParams(), "prompt 0 has 2.0, which is not an integer token id"),
    (7, SamplingParams(), "prompt 0 must be a string or a list of token ids, got int"),
    ("hello", SamplingParams(), "prompt 0 is a string; add_request takes token ids"),
])
def test_bad_prompts_rejected_before_work(qwen3, prompt, params, match):
    engine = make_engine(qwen3)
    if match is None:
        with pytest.raises(ValueError, match=r"sample_indices=\[7\]"):
            engine.add_request(prompt, params, sample_indices=[7])
    else:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, params)
    assert not engine.has_unfinished()
    assert run(engine, [[5, 6, 7]], GREEDY)[(0, 0)]["finish_reason"] == "length"


def test_prompts_as_arrays_and_all_checked_before_any_is_queued(qwen3):
    engine = make_engine(qwen3, num_blocks=4)
    arrays = [np.array([5, 6, 7]), torch.tensor([5, 6, 7]), (5, 6, 7), list(torch.tensor([5, 6, 7])),
              list(np.array([5, 6, 7]))]  # lists of scalars too, as `list(tensor)` makes them
    assert engine.tokenize(arrays) == [[5, 6, 7]] * 5
    for token in (torch.tensor(True), torch.tensor([6]), torch.tensor(6.0), torch.tensor(6, device="meta")):
        with pytest.raises(ValueError, match=r"prompt 0 has tensor\(.*\), which is not an integer token id"):
            engine.tokenize([[5, token]])
    with pytest.raises(ValueError, match=r"prompt 1 \(70 tokens\) .* needs 6 blocks"):
        engine.generate([[1, 2, 3], list(range(5, 75))], GREEDY)
    assert not engine.has_unfinished(), "the first prompt was not queued"



def test_string_prompts_get_the_tokenizers_bos_once(model_dir):
    """A string is encoded as `tokenizer(text)` encodes it, BOS included; a text that already begins with the
    BOS (a chat template rendered to text) gets no second one. The greedy completion equals `generate`'s."""
    path = model_dir("llama", bos=True)
    engine = make_engine(path)
    plain = "Two plus two equals"
    ids = engine.tokenize([plain, engine.tokenizer.bos_token + plain])
    bos = engine.tokenizer.bos_token_id
    assert ids[0] == engine.tokenizer(plain)["input_ids"] and ids[0][0] == bos and ids[0].count(bos) == 1
    assert ids[1] == ids[0]
    table = engine.generate([plain], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert table["prompt_token_ids"][0].as_py() == ids[0]
    assert table["token_ids"][0].as_py() == hf_greedy(path, ids[0], 8)


@pytest.mark.parametrize("field, value", [("n", 0), ("temperature", -1.0), ("top_p", 0.0),
                                          ("max_new_tokens", -3), ("logprobs_mode", "bogus")])
def test_sampling_params_set_after_they_were_built_are_checked_again(qwen3, field, value):
    """A field set on a built `SamplingParams` (msgspec structs are mutable) is refused when the request
    comes, before anything is queued."""
    engine = make_engine(qwen3)
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished()


def test_bad_configs(qwen3, tmp_path):
    with pytest.raises(ValueError, match="bogus"):
        convert({"model": qwen3, "bogus": 1}, EngineConfig)
    with pytest.raises(ValueError, match="block_size"):
        convert({"model": qwen3, "block_size": "big"}, EngineConfig)
    with pytest.raises(ValueError, match="dtype='float8'"):
        EngineConfig(model=qwen3, dtype="float8")
    with pytest.raises(ValueError, match="max_batch_tokens=2.5 is not of type int"):
        EngineConfig(model=qwen3, max_batch_tokens=2.5)
    with pytest.raises(ValueError, match="enable_prefix_caching='no' is not of type bool"):
        EngineConfig(model=qwen3, enable_prefix_caching="no")
    with pytest.raises(ValueError, match="cpu_offload_gib=inf"):
        EngineConfig(model=qwen3, cpu_offload_gib=float("inf"))
    with pytest.raises(ValueError, match="not a model directory"):
        Engine(EngineConfig(model=str(tmp_path / "missing")))


def test_request_larger_than_cache_is_refused(qwen3):
    engine = make_engine(qwen3, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        engine.add_request([5] * 10, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_engine(qwen3, max_num_seqs=4).add_request([5] * 3, SamplingParams(n=5))


def test_check_integrity_fails_the_step_that_breaks_accounting(qwen3):
    """With `check_integrity`, every step proves the block accounting; a leaked block fails the next step."""
    engine = make_engine(qwen3, check_integrity=True)
    engine.add_request([5, 6, 7], SamplingParams(n=2, max_new_tokens=8))
    engine.step()
    engine.pool.allocate(1)  # a block that no sequence holds
    with pytest.raises(AssertionError, match="refcounts"):
        engine.step()

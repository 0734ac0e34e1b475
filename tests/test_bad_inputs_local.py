"""Bad input through the entries that need no Ray (`Engine` with its `EngineConfig`, config files, the `rollout`
command), as property tests: each kind is refused before any work (the engine's counters do not move; the CLI
starts no Ray and writes nothing) with an error naming the bad value or field."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from rollout import SamplingParams
from rollout.cli import main
from rollout.config import ATTENTION_BACKENDS, DTYPES, PLACEMENT_STRATEGIES, EngineConfig, load_service_config
from tests.bad_inputs import BAD_PROMPTS, VOCAB, ids, refused, report
from tests.conftest import make_engine

CHECKS = settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
ENTRIES = ["Engine", "config files", "CLI"]
finite = dict(allow_nan=False, allow_infinity=False)
words = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
not_int = st.floats(**finite) | st.text(max_size=3) | st.booleans()
# kind -> (EngineConfig field, strategy of bad values)
BAD_ENGINE_CONFIG = {
    "size below 1": (st.sampled_from(["block_size", "num_blocks", "max_batch_tokens", "max_num_seqs"]),
                     st.integers(max_value=0)),
    "length below a prompt and a token": (st.just("max_model_len"), st.integers(max_value=1)),
    "size not an int": (st.sampled_from(["block_size", "max_batch_tokens", "max_num_seqs"]), not_int),
    "memory share outside (0, 1]": (st.just("gpu_memory_utilization"), st.floats(min_value=1, exclude_min=True,
                                                                                 **finite) | st.floats(max_value=0)),
    "memory size not positive": (st.sampled_from(["kv_cache_memory_gib"]), st.floats(max_value=0, **finite)),
    "negative offload": (st.just("cpu_offload_gib"), st.floats(max_value=0, exclude_max=True, **finite)),
    "non-finite number": (st.sampled_from(["cpu_offload_gib", "gpu_memory_utilization"]),
                          st.sampled_from([float("nan"), float("inf")])),
    "unknown choice": (st.sampled_from(["dtype", "device", "attention_backend"]),
                       words.filter(lambda w: w not in (*DTYPES, "cpu", "cuda", *ATTENTION_BACKENDS))),
    "device index not an integer": (st.just("device"), st.sampled_from(["cuda:", "cuda:x", "cuda:-1", "cuda:01",
                                                                         "cuda:0:1", "cuda:1.0", "cpu:", "cpu:1"])),
    "block ids beyond int32": (st.just("num_blocks"), st.integers(min_value=2**31, max_value=2**62)),
    "flag not a bool": (st.sampled_from(["trust_remote_code", "enable_prefix_caching"]), st.integers() | st.none()),
    "model path not a string": (st.just("model"), st.integers() | st.none() | st.lists(st.text(), max_size=1)),
    "graph flags not a (varlen, decode) pair of bools": (
        st.just("cuda_graphs"), st.integers() | st.text(max_size=3) | st.lists(st.booleans(), max_size=3)
        | st.tuples(st.integers(), st.integers()) | st.tuples(st.booleans()) | st.tuples(*[st.booleans()] * 3)),
    "varlen graphs": (st.just("cuda_graphs"), st.tuples(st.just(True), st.booleans())),
}


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir("qwen3"))


@pytest.mark.parametrize("kind", sorted(BAD_ENGINE_CONFIG))
@given(data=st.data())
@CHECKS
def test_bad_engine_configs_are_refused_naming_the_field(model_dir, data, kind):
    fields, values = BAD_ENGINE_CONFIG[kind]
    field, value = data.draw(fields), data.draw(values)
    config = {"model": model_dir("qwen3"), field: value}
    with refused("Engine", kind, f"EngineConfig.{field}="):
        EngineConfig(**config)


def test_unknown_engine_fields_and_missing_models_are_refused(tmp_path):
    with refused("Engine", "unknown config field", "bogus", TypeError):
        EngineConfig(model=str(tmp_path), bogus=1)
    with refused("Engine", "model directory without config.json", f"EngineConfig.model={str(tmp_path)!r}"):
        make_engine(str(tmp_path))


def test_a_truncated_weights_file_is_refused_naming_the_model(model_dir, tmp_path):
    """safetensors' own error (not an OSError) escaped as it was, naming neither the model nor the file's fault."""
    model = shutil.copytree(model_dir("qwen3"), tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with refused("Engine", "truncated weights file", f"cannot load a causal LM from {str(model)!r}"):
        make_engine(str(model))


@pytest.mark.parametrize("dropped", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_a_checkpoint_missing_weights_is_refused_naming_them(model_dir, tmp_path, dropped):
    """transformers filled a missing tensor (a lost shard's, or the LM head of a base or reward model saved
    without it) with random values, and the engine served that model of its own: each load sampled anew."""
    model = shutil.copytree(model_dir("qwen3", tie_word_embeddings=False), tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    del weights[dropped]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with refused("Engine", "checkpoint missing weights", f"lacks 1 of the model's weights ({dropped})"):
        make_engine(str(model))


def test_a_device_this_machine_lacks_is_refused_naming_it(model_dir):
    """A CPU build of torch, or an index past the last GPU: not torch's error from deep inside transformers."""
    device = f"cuda:{torch.cuda.device_count()}"
    with refused("Engine", "device not on this machine", f"EngineConfig.device={device!r} is not a device here"):
        make_engine(model_dir("qwen3"), device=device)


def test_generate_needs_an_idle_engine(engine):
    """The rows of requests added with `add_request` joined `generate`'s table (prompt indices clashing), and
    their caller never got them."""
    request_id = engine.add_request([5, 6, 7], SamplingParams(n=2, max_new_tokens=3))
    before = engine.stats()
    with refused("Engine", "generate on a busy engine", "generate() needs an idle engine", RuntimeError):
        engine.generate([[4, 5]], SamplingParams(max_new_tokens=3))
    assert engine.stats() == before
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
    assert sorted(row["request_id"] for row in rows) == [f"{request_id}/0", f"{request_id}/1"]


@pytest.mark.parametrize("kind", sorted(BAD_PROMPTS))
@given(data=st.data())
@CHECKS
def test_bad_prompts_are_refused_by_the_engine(engine, data, kind):
    bad, message = data.draw(BAD_PROMPTS[kind])
    prompts = data.draw(st.lists(ids, max_size=3))
    index = data.draw(st.integers(0, len(prompts)))
    prompts.insert(index, bad)
    before = engine.stats()
    with refused("Engine", kind, message.format(i=index)):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    if not isinstance(bad, str):
        with refused("Engine", kind, message.format(i=7)):
            engine.add_request(bad, SamplingParams(), prompt_index=7)
    assert engine.stats() == before and not engine.has_unfinished()


@pytest.mark.parametrize("call, names, kind", [
    (lambda e: e.add_request([5, 6], {"n": 2}), "params must be a SamplingParams, got dict",
     "params not SamplingParams"),
    (lambda e: e.generate([[5, 6]], None), "params must be a SamplingParams, got NoneType", "params missing"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), sample_indices=[2]), "sample_indices=[2]",
     "sample index out of range"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), sample_indices=[]), "sample_indices=[]",
     "no sample indices"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), sample_indices=[1.0]), "sample_indices=[1.0]",
     "a float sample index"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), sample_indices=[True]), "sample_indices=[True]",
     "a bool sample index"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), sample_indices=1), "sample_indices=1",
     "sample indices not a list"),
    (lambda e: e.generate([[5, 6]], SamplingParams(n=300)), "300 samples of one prompt exceed max_num_seqs=256",
     "more samples than max_num_seqs"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=2), repeat=-1), "repeat=-1", "negative repeat"),
    (lambda e: e.add_request([5, 6], SamplingParams(stop_token_ids=[7, VOCAB])),
     f"stop_token_ids has {VOCAB}, outside the vocabulary [0, {VOCAB})", "stop token beyond the vocabulary"),
])
def test_bad_requests_are_refused_by_the_engine(engine, call, names, kind):
    before = engine.stats()
    with refused("Engine", kind, names):
        call(engine)
    assert engine.stats() == before and not engine.has_unfinished()


TOML_BASE = {"num_workers": 2, "engine": {"model": "/m", "device": "cpu"}}
# kind -> strategy of (change to the base config, the text its error must hold)
BAD_TOML = {
    "unknown key": words.map(lambda w: ({f"x_{w}": 1}, f"unknown field `x_{w}`")),
    "unknown engine key": words.map(lambda w: ({"engine": {"model": "/m", f"x_{w}": 1}}, f"x_{w}")),
    "wrong type": st.sampled_from([
        ({"num_workers": "two"}, "$.num_workers"), ({"flush_delay_s": "0.1"}, "$.flush_delay_s"),
        ({"engine": {"model": "/m", "block_size": 1.5}}, "$.engine.block_size"),
        ({"engine": {"model": 3}}, "$.engine.model")]),
    "out of range": st.sampled_from(["num_workers", "flush_rows"]).flatmap(
        lambda f: st.integers(-(2**62), 0).map(lambda v: ({f: v}, f"ServiceConfig.{f}={v}"))),
    "not positive": st.sampled_from(["cpus_per_worker", "placement_timeout_s", "object_store_memory_gib"]).flatmap(
        lambda f: st.floats(max_value=0, **finite).map(lambda v: ({f: v}, f"ServiceConfig.{f}="))),
    "unknown strategy": words.filter(lambda w: w not in PLACEMENT_STRATEGIES).map(
        lambda w: ({"placement_strategy": w}, f"ServiceConfig.placement_strategy={w!r}")),
    "empty name": st.just(({"name": ""}, "ServiceConfig.name")),
    "missing model": st.just(({"engine": {"device": "cpu"}}, "missing required field `model`")),
}


def toml(data: dict) -> str:
    """TOML text of a flat config with an [engine] table."""
    top = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items() if k != "engine")
    return top + "[engine]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.get("engine", {}).items())


@pytest.mark.parametrize("kind", sorted(BAD_TOML))
@given(data=st.data())
@CHECKS
def test_bad_config_files_are_refused_naming_the_field(tmp_path_factory, data, kind):
    change, names = data.draw(BAD_TOML[kind])
    path = tmp_path_factory.mktemp("config") / "service.toml"
    path.write_text(toml({**TOML_BASE, **change}))
    with refused("config files", kind, names):
        load_service_config(path)


def test_unreadable_config_files_are_refused_naming_the_file(tmp_path):
    cases = {"not TOML": b"num_workers = = 2\n", "not UTF-8": b"\xff\xfe\x00garbage"}
    for kind, text in cases.items():
        path = tmp_path / f"{kind}.toml"
        path.write_bytes(text)
        with refused("config files", kind, f"config file {str(path)!r} is not valid TOML"):
            load_service_config(path)
    with refused("config files", "missing file", "does not exist"):
        load_service_config(tmp_path / "missing.toml")
    with refused("config files", "a directory", f"config file {str(tmp_path)!r} is not a file"):
        load_service_config(tmp_path)


@pytest.fixture
def cli(tmp_path, model_dir, capsys, monkeypatch):
    """`run(*argv)` -> the error the CLI printed; asserts exit status 2, no Ray started, no output written."""
    monkeypatch.setattr("rollout.api.start_local_ray", lambda config: pytest.fail("Ray started before the refusal"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"hello"\n[5, 6, 7]\n')
    out = tmp_path / "out.parquet"

    def run(*argv: str, prompt_lines: str | None = None) -> str:
        if prompt_lines is not None:
            prompts.write_text(prompt_lines)
        base = ["sample", "--model", model_dir("qwen3"), "--prompts", str(prompts), "--out", str(out)]
        with pytest.raises(SystemExit) as exit_:
            main([*base, *argv] if argv[:1] != ("RAW",) else list(argv[1:]))
        assert exit_.value.code == 2 and not ray.is_initialized() and not out.exists()
        return capsys.readouterr().err

    return run, tmp_path


@pytest.mark.parametrize("argv, lines, names, kind", [
    (["--n", "0"], None, "SamplingParams.n=0", "samples per prompt below 1"),
    (["--temperature", "nan"], None, "SamplingParams.temperature=nan", "non-finite temperature"),
    (["--top-p", "1.5"], None, "SamplingParams.top_p=1.5", "top_p above 1"),
    (["--top-k", "abc"], None, "invalid int value: 'abc'", "number flag not a number"),
    (["--logprobs-mode", "all"], None, "SamplingParams.logprobs_mode='all'", "unknown logprobs mode"),
    (["--stop-token-ids", "-3"], None, "stop_token_ids=[-3]", "negative stop token id"),
    (["--seed", "-1"], None, "SamplingParams.seed=-1", "negative seed"),
    (["--bogus"], None, "unrecognized arguments: --bogus", "unknown flag"),
    (["--set", "flush_rows"], None, "--set 'flush_rows' must have the form FIELD=VALUE", "--set without a value"),
    (["--set", "bogus=1"], None, "unknown field `bogus`", "--set of an unknown field"),
    (["--set", "placement_strategy='EVERYWHERE'"], None, "placement_strategy='EVERYWHERE'", "--set out of choices"),
    (["--num-workers", "0"], None, "ServiceConfig.num_workers=0", "no workers"),
    ([], "[5, -2]\n", "-2 is not a token id", "negative token id in the prompt file"),
    ([], '[5, "x"]\n', "'x' is not a token id", "token id not an int in the prompt file"),
    ([], "[5, true]\n", "True is not a token id", "token id a bool in the prompt file"),
    ([], "{\"text\": \"hi\"}\n", "an object needs a \"prompt\" field, got keys ['text']", "object without a prompt"),
    ([], "[5, 6\n", "not JSON", "prompt line not JSON"),
    ([], "\n\n", "holds no prompts", "empty prompt file"),
    ([], "[]\n", "the prompt is empty", "empty prompt in the file"),
    ([], '"ok"\n5\n', ':2: expected a string, a token-id list or {"prompt": ...}, got 5', "prompt of a wrong type"),
])
def test_bad_command_lines_are_refused_before_ray_starts(cli, argv, lines, names, kind):
    run, _ = cli
    with refused("CLI", kind, names):
        raise ValueError(run(*argv, prompt_lines=lines))  # what the CLI printed, checked by `refused`


@pytest.mark.parametrize("prompts", ["abc", [[5, 6], (t for t in [5])]])
def test_bad_prompts_are_refused_before_the_first_call_starts_the_service(monkeypatch, prompts):
    from rollout import api
    monkeypatch.setattr(api, "_service", None)
    monkeypatch.setattr(api, "init", lambda *args, **kwargs: pytest.fail("the service started first"))
    with pytest.raises(ValueError, match="prompts must be a non-empty list|prompt 1 must be a string"):
        api.sample(prompts, n=2)


def test_bad_paths_on_the_command_line_are_refused(cli, request):
    run, tmp = cli
    cases = {"missing prompt file": (["--prompts", str(tmp / "nope.jsonl")], "does not exist"),
             "output is a directory": (["--out", str(tmp)], "is a directory"),
             "output directory missing": (["--out", str(tmp / "no" / "x.parquet")], "does not exist"),
             "missing config file": (["--config", str(tmp / "no.toml")], "does not exist")}
    for kind, (argv, names) in cases.items():
        with refused("CLI", kind, names):
            raise ValueError(run(*argv))
    assert re.search("error: ", run("RAW", "sample"))  # required flags missing
    report(ENTRIES, minimum=40, request=request)

"""Bad input through the service's public entries (`rollout.sample`, `RolloutClient`, `update_weights`), as
property tests: every kind is refused before any work (the workers' counters do not move, no sample is
made, the weights keep their version) with an error naming the bad value or field; the service serves on."""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from typing import Iterator

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rollout
from rollout.params import LOGPROBS_MODES, SamplingParams
from tests.bad_inputs import BAD_PROMPTS, VOCAB, ids, refused, report
from tests.conftest import make_engine
from tests.model_zoo import build_zoo_model
from trainer_client import RolloutClient

MAX_SEQS, BLOCKS = 8, 32  # the service below
CHECKS = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))  # per kind
ENTRIES = ["rollout.sample", "RolloutClient", "update_weights"]


def test_a_model_the_engine_refuses_fails_init_with_the_engines_error(tmp_path):
    """Runs before the module's service starts: `rollout.init` raises the engine's own ValueError, naming
    the model type and the feature (not Ray's ActorDiedError with it deep in a traceback), and leaves no
    Ray behind."""
    path = build_zoo_model("llama4_text", tmp_path)
    with pytest.raises(ValueError, match=r"^model type 'llama4_text' is not supported .* chunked attention"):
        rollout.init(model=path, num_workers=1, object_store_memory_gib=0.3)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def service(model_dir):
    model = model_dir("qwen3")
    rollout.init(model=model, num_workers=2, max_num_seqs=MAX_SEQS, num_blocks=BLOCKS, object_store_memory_gib=0.3)
    yield RolloutClient.connect(name="rollout", namespace="rollout"), model
    rollout.shutdown()


@contextmanager
def no_work(client: RolloutClient) -> Iterator[None]:
    """The workers' counters (steps, prefill and decode tokens, blocks, versions) are the same afterwards."""
    before = client.stats()
    yield
    assert client.stats() == before


def sample_entries(client: RolloutClient) -> list:
    return [("rollout.sample", rollout.sample), ("RolloutClient", client.sample)]


@pytest.mark.parametrize("kind", sorted(BAD_PROMPTS))
@given(data=st.data(), which=st.integers(0, 1))
@CHECKS
def test_bad_prompts_are_refused_naming_the_prompt(service, data, kind, which):
    client, _ = service
    bad, message = data.draw(BAD_PROMPTS[kind])
    prompts = data.draw(st.lists(ids, max_size=3))
    index = data.draw(st.integers(0, len(prompts)))
    prompts.insert(index, bad)
    entry, sample = sample_entries(client)[which]
    with no_work(client), refused(entry, kind, message.format(i=index)):
        sample(prompts, n=2, max_new_tokens=4)


@pytest.mark.parametrize("prompts, names, kind", [
    ("abc", "prompts must be a non-empty list, got 'abc'", "prompts not a list"),
    ([], "prompts must be a non-empty list, got []", "no prompts"),
    ({"a": [1]}, "prompts must be a non-empty list", "prompts a dict"),
])
def test_bad_prompt_lists_are_refused(service, prompts, names, kind):
    client, _ = service
    for entry, sample in sample_entries(client):
        with no_work(client), refused(entry, kind, names):
            sample(prompts, n=1)


finite = dict(allow_nan=False, allow_infinity=False)
# kind -> (field, strategy of bad values)
BAD_SAMPLING = {
    "n below 1": ("n", st.integers(max_value=0)),
    "n not an int": ("n", st.floats(**finite) | st.text(max_size=3) | st.booleans() | st.none()),
    "negative temperature": ("temperature", st.floats(max_value=-1e-9, **finite)),
    "non-finite float": ("temperature", st.sampled_from([math.nan, math.inf, -math.inf])),
    "top_p outside (0, 1]": ("top_p", st.floats(min_value=1, exclude_min=True, **finite)
                             | st.floats(max_value=0, **finite)),
    "negative top_k": ("top_k", st.integers(max_value=-1)),
    "min_p outside [0, 1]": ("min_p", st.floats(min_value=1, exclude_min=True, **finite)
                             | st.floats(max_value=0, exclude_max=True, **finite)),
    "max_new_tokens below 1": ("max_new_tokens", st.integers(max_value=0)),
    "negative stop token id": ("stop_token_ids", st.lists(st.integers(max_value=-1), min_size=1, max_size=3)),
    "stop_token_ids not a list of ints": ("stop_token_ids", st.integers() | st.lists(st.text(max_size=2), min_size=1)),
    "seed outside [0, 2**64)": ("seed", st.integers(max_value=-1) | st.integers(min_value=2**64)),
    "unknown logprobs_mode": ("logprobs_mode", st.text(max_size=8).filter(lambda m: m not in LOGPROBS_MODES)),
    "flag not a bool": ("ignore_eos", st.integers() | st.text(max_size=2)),
    "unknown sampling argument": (None, st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(
        lambda name: name not in (*SamplingParams.__struct_fields__, "prompts", "progress"))),
}


@pytest.mark.parametrize("kind", sorted(BAD_SAMPLING))
@given(data=st.data(), which=st.integers(0, 1))
@CHECKS
def test_bad_sampling_arguments_are_refused_naming_the_field(service, data, kind, which):
    client, _ = service
    field, values = BAD_SAMPLING[kind]
    value = data.draw(values)
    sampling = {value: 1} if field is None else {field: value}
    names = re.compile(f"unknown field `{value}`" if field is None
                       else rf"(SamplingParams\.{field}=|\$\.{field}[`\[])")
    entry, sample = sample_entries(client)[which]
    with no_work(client), refused(entry, kind, names):
        sample([[5, 6, 7]], **sampling)


@pytest.mark.parametrize("sampling, prompt, names, kind", [
    (dict(n=MAX_SEQS + 1), [5, 6], f"prompt 0: {MAX_SEQS + 1} samples of one prompt exceed max_num_seqs={MAX_SEQS}",
     "more samples than max_num_seqs"),
    (dict(n=1, max_new_tokens=100), [5] * 600,
     re.compile(rf"prompt 1 \(600 tokens\).* the cache has {BLOCKS} \(num_blocks={BLOCKS}\)"),
     "request beyond the KV cache"),
    (dict(stop_token_ids=[VOCAB + 3]), [5, 6], f"stop_token_ids has {VOCAB + 3}, outside the vocabulary [0, {VOCAB})",
     "stop token beyond the vocabulary"),
])
def test_requests_the_engine_could_never_hold_are_refused(service, sampling, prompt, names, kind):
    client, _ = service
    for entry, sample in sample_entries(client):
        with no_work(client), refused(entry, kind, names):
            sample([[5, 6], prompt], **sampling)


def test_connect_to_a_missing_service_names_it(service):
    with refused("RolloutClient", "unknown service name", "no rollout service 'nope'", TimeoutError):
        RolloutClient.connect(name="nope", timeout_s=1.0)


@pytest.fixture(scope="module")
def weights(service):
    """The model's own state dict (float32 CPU tensors): the valid update each bad one is made from."""
    return {k: v.clone() for k, v in make_engine(service[1]).state_dict().items()}


def corrupt(weights: dict, name: str, how: str) -> tuple[dict, str]:
    state = dict(weights)
    tensor = state[name]
    if how == "shape":
        state[name] = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] + 1)
        return state, f"{name!r} has shape"
    if how == "dtype":
        state[name] = tensor.to(torch.float64)
        return state, f"{name!r} has dtype torch.float64"
    if how == "missing":
        del state[name]
        return state, f"missing {name!r}"
    state[name + ".bogus"] = tensor
    return state, f"unexpected {name + '.bogus'!r}"


@pytest.mark.parametrize("how", ["shape", "dtype", "missing", "unexpected"])
@given(data=st.data(), which=st.integers(0, 1))
@settings(CHECKS, max_examples=4)
def test_weights_of_wrong_names_shapes_or_dtypes_are_refused(service, weights, data, how, which):
    client, _ = service
    name = data.draw(st.sampled_from(sorted(weights)))
    state, names = corrupt(weights, name, how)
    update = [rollout.update_weights, client.update_weights][which]
    with no_work(client), refused("update_weights", f"tensor of a wrong {how}" if how in ("shape", "dtype")
                                  else f"{how} tensor name", names):
        update(state, version=1)


@pytest.mark.parametrize("source, args, names, error, kind", [
    ("ok", dict(version=-1), "version=-1", ValueError, "negative version"),
    ("ok", dict(version=1.0), "version=1.0", ValueError, "version not an int"),
    ("ok", dict(version=True), "version=True", ValueError, "version a bool"),
    ("ok", dict(version=2**63), f"version={2**63}", ValueError, "version beyond int64"),
    ("ok", dict(version=1, mode="later"), "mode='later'", ValueError, "unknown mode"),
    ("ok", dict(version=1, transport="pigeon"), "transport='pigeon'", ValueError, "unknown transport"),
    ("ok", dict(version=1, transport="broadcast"), "init_weight_sync", RuntimeError, "broadcast without a group"),
    ("ok", dict(version=1, transport="checkpoint"), "transport='checkpoint' needs a directory path, got dict",
     ValueError, "state dict as a checkpoint"),
    (5, dict(version=1), "got int", ValueError, "source of a wrong type"),
    ({}, dict(version=1), "non-empty state dict", ValueError, "empty state dict"),
    ({"w": [1.0]}, dict(version=1), "state dict entry 'w' is a list", ValueError, "entry not a tensor"),
    ({"w": torch.empty(2, device="meta")}, dict(version=1), "state dict entry 'w' is a meta tensor", ValueError,
     "entry without values"),
    ("/nonexistent/ckpt", dict(version=1), "checkpoint '/nonexistent/ckpt' is not a directory", ValueError,
     "missing checkpoint directory"),
])
def test_bad_update_arguments_are_refused(service, weights, source, args, names, error, kind):
    client, _ = service
    source = weights if source == "ok" else source
    for update in (rollout.update_weights, client.update_weights):
        with no_work(client), refused("update_weights", kind, names, error):
            update(source, **args)


def test_the_service_serves_on_after_every_bad_input(service, request):
    client, _ = service
    table = rollout.sample([[5, 6, 7], "The capital of France is"], n=3, max_new_tokens=5).to_table()
    assert table.num_rows == 6 and {s["policy_version"] for s in client.stats().values()} == {0}
    report(ENTRIES, minimum=40, request=request)

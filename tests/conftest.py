"""Shared fixtures: tiny random models built once per session, and an engine driver that checks
block accounting after every step."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import transformers
from transformers.quantizers.auto import AutoQuantizationConfig

ON_GPU = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):  # parallel test processes share the cores: one torch thread each
    torch.set_num_threads(1)
# Triton kernels run in its interpreter on a machine without CUDA; set before anything imports triton.
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout import SamplingParams  # noqa: E402
from tests.bad_inputs import LEFT_OUT, RAN  # noqa: E402
from tests.model_zoo import ZOO, build_zoo_model  # noqa: E402
from workers.engine import Engine, EngineConfig, model_loading  # noqa: E402
from workers.engine.tiny_models import build_tiny_model  # noqa: E402

# parametrize with DEVICES to run a test on the CPU, and on the GPU where there is one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"))]


class CudaLooking(torch.Tensor):
    """A CPU tensor that reports `is_cuda`, to drive GPU-only branches and device checks without a GPU."""

    is_cuda = property(lambda self: True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note each test this process runs, for the bad-input count (`tests.bad_inputs.report`)."""
    if report.when == "call":
        RAN.add(report.nodeid)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Note the tests `-k` or `-m` left out, for the same count."""
    LEFT_OUT.update(item.path for item in items)


ARCH_OVERRIDES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 24},
    "gemma2": {"sliding_window": 16, "attn_logit_softcapping": 2.0, "final_logit_softcapping": None,
               "query_pre_attn_scalar": 24},
}


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory):
    """`zoo_dir(name, seed=0, **overrides)` -> directory of the tiny random model of `tests.model_zoo` entry
    `name` (its config fields updated by `overrides`), built once per session."""

    @functools.cache
    def build(name: str, seed: int = 0, **overrides) -> str:
        if ZOO[name][0] is None:
            pytest.skip(f"transformers {transformers.__version__} has no config class for {name!r}")
        return build_zoo_model(name, tmp_path_factory.mktemp(name), seed, **overrides)

    return build


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """`model_dir(arch, **overrides)` -> path of a tiny random model, built once per argument set."""

    @functools.cache
    def build(arch: str = "qwen3", **overrides) -> str:
        path = tmp_path_factory.mktemp(arch)
        return str(build_tiny_model(path, arch, **{**ARCH_OVERRIDES.get(arch, {}), **overrides}))

    return lambda arch="qwen3", **overrides: build(arch, **overrides)


def simulate_sms(monkeypatch, num_sms: int) -> None:
    """Make the Triton backend choose its KV split counts as on a card of `num_sms` multiprocessors."""
    from workers.engine.attention import triton_backend
    choose = triton_backend.choose_num_splits
    monkeypatch.setattr(triton_backend, "choose_num_splits", lambda *args: choose(*args[:4], num_sms, *args[5:]))


@functools.cache
def gib_per_block(model: str, block_size: int) -> float:
    """GiB of KV one cache block of `model` holds in float32 on the CPU, read from an engine's own cache."""
    return make_engine(model, block_size=block_size, num_blocks=8).runner.kv_cache.nbytes / 8 / 2**30


def make_engine(model: str, **config) -> Engine:
    """An in-process CPU float32 engine with test-sized defaults."""
    defaults = dict(device="cpu", dtype="float32", block_size=16, num_blocks=256, max_batch_tokens=256)
    return Engine(EngineConfig(model=model, **{**defaults, **config}))


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        max_steps: int = 100_000) -> dict[tuple[int, int], dict]:
    """Drive `engine` step by step, checking integrity after each; rows keyed by (prompt, sample)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, prompt_index=i)
    rows = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for row in engine.step():
            key = (row["prompt_index"], row["sample_index"])
            assert key not in rows, f"sample {key} finished twice"
            rows[key] = row
        engine.check_integrity()
    assert not engine.has_unfinished(), "engine did not finish within max_steps"
    assert_nothing_leaked(engine)
    return rows


def assert_nothing_leaked(engine: Engine) -> None:
    """Every block is free or cached once nothing runs."""
    stats = engine.stats()
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]
    assert not engine.groups


@contextmanager
def ctrl_c_at_step(engine: Engine, n: int) -> Iterator[None]:
    """Within the block, the `n`-th call of `engine.step` raises KeyboardInterrupt (Ctrl-C), which the block
    must end with; afterwards `step` is the engine's own again."""
    step, calls = engine.step, []

    def interrupted() -> list[dict]:
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        del engine.step


def hf_model(path: str) -> transformers.PreTrainedModel:
    """The same checkpoint through plain transformers, float32, eager attention: the exact reference
    (some transformers versions default Gemma2 to sdpa, which drops its logit softcap). A quantized one is
    dequantized on load, as README tells a trainer to (transformers 5.17 on torch 2.6 fails to load MXFP4
    without an accelerator otherwise)."""
    config = model_loading.load_config(path)
    quant = getattr(config, "quantization_config", None)
    options = {}
    if quant is not None:
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        options["quantization_config"] = AutoQuantizationConfig.from_dict({**quant, "dequantize": True})
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                             attn_implementation="eager", **options).eval()


def hf_greedy(path: str, prompt: list[int], new: int = 10) -> list[int]:
    """`new` greedy tokens after `prompt` from plain transformers `generate` (eos ignored)."""
    out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """`count` prompts of random tokens (avoiding the special ids 0 and 1) with mixed lengths."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen).tolist()
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in sizes]

"""flash-linear-attention (fla) installed beside transformers: transformers then runs fla's Triton kernels for
Gated DeltaNet layers on any device, and importing fla registers fla's own models over transformers'
'mamba' and 'mamba2'. The engine keeps transformers' models, refuses the CPU with a clear error, and on a
GPU gives transformers' tokens through fla's kernels.

The real-fla tests run where fla is importable: scripts/gpu_check.sh runs this file with fla on the path
(on the CPU, `PYTHONPATH=<a folder holding fla-core, flash-linear-attention and einops>` does). Importing
fla changes transformers for the whole process, so the rest of the suite runs without it.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5

from tests.conftest import ON_GPU, hf_model, make_engine
from tests.model_zoo import build_zoo_model
from tests.test_model_coverage import assert_exact, prompts_of
from tests.test_recurrent import LENGTHS, assert_every_sample_exact
from workers.engine import model_loading

HAS_FLA = importlib.util.find_spec("fla") is not None
# the families whose linear-attention layers transformers 5.17 and later route to fla's kernels, with their
# linear heads widened from the zoo's 8 to 32 (fla's tiles are 16 wide and more); in this order on the card, where
# fla autotunes each kernel on first use: the three Gated DeltaNet families share their kernels, Kimi's own come last
_DELTA_32 = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
FLA_FAMILIES = {"qwen3_5_text": _DELTA_32, "qwen3_next": _DELTA_32, "olmo_hybrid": _DELTA_32,
                "kimi_linear": {"linear_head_dim": 32}}
# fla's modules whose triangular solve (the chunked delta rules' (I + A)^-1) is TF32 on any NVIDIA card from sm_80,
# whatever TRITON_F32_DEFAULT says: with it, OLMo hybrid (beta up to 2) and Kimi Linear fed whole and fed in pieces
# were 2.1e-3 and 1.4e-3 apart on an H200 (tenth and eleventh GPU sessions), where Triton's interpreter agrees to 1.5e-7
# (set to IEEE: every family within 1e-4 on an H200, twelfth)
TF32_SOLVES = ("fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.kda.chunk_intra")


@pytest.fixture(autouse=True, scope="module")
def ieee_float32():
    """fla's chunked kernels leave their float32 products' precision to Triton, whose default is TF32: there the
    engine's logprobs, prefilled in other chunks than the reference's, were off by up to 3.4e-3 (H100,
    2026-11-26). TRITON_F32_DEFAULT makes them IEEE. It is set for the whole module, before any fla kernel
    compiles: Triton keys the kernels it keeps in memory by their arguments, not by this variable. The layers'
    short convolutions (torch's conv1d: cuDNN) are TF32 by torch's default too, so that is off as well. With it
    on, OLMo hybrid's logprobs were 1.5e-3 off on an H200 (2026-11-27), where the same test, fla's kernels
    included, is exact under Triton's interpreter on the CPU; with it off (tenth GPU session) the model alone was
    still 2.1e-3 off itself: fla's triangular solves name their precision, TF32, so that is set too (TF32_SOLVES)."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TRITON_F32_DEFAULT", "ieee")
            if HAS_FLA and ON_GPU:
                import triton.language as tl

                for name in TF32_SOLVES:
                    patch.setattr(importlib.import_module(name), "SOLVE_TRIL_DOT_PRECISION", tl.constexpr("ieee"))
            yield
    finally:  # torch's backend flags are properties of module objects, which monkeypatch cannot restore
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


class ThirdPartyMamba2Config(transformers.Mamba2Config):
    """A package's own config registered over transformers' 'mamba2', as fla's is."""


class ThirdPartyMamba2ForCausalLM(transformers.Mamba2ForCausalLM):
    """A package's own model for it, which the engine must never run."""

    config_class = ThirdPartyMamba2Config

    def forward(self, *args, **kwargs):
        raise AssertionError("the third-party model ran")


def test_a_package_registered_over_a_transformers_type_does_not_replace_its_model(zoo_dir, monkeypatch):
    """A class registered over 'mamba2' (public `register`, undone after the test) does not reach the engine:
    it loads transformers' config and model, and stays exact."""
    config_mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    model_mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    monkeypatch.setattr(config_mapping, "_extra_content", dict(config_mapping._extra_content))
    monkeypatch.setattr(model_mapping, "_extra_content", dict(model_mapping._extra_content))
    transformers.AutoConfig.register("mamba2", ThirdPartyMamba2Config, exist_ok=True)
    transformers.AutoModelForCausalLM.register(ThirdPartyMamba2Config, ThirdPartyMamba2ForCausalLM, exist_ok=True)
    path = zoo_dir("mamba2")
    assert type(transformers.AutoConfig.from_pretrained(path)) is ThirdPartyMamba2Config
    assert type(model_loading.load_config(path)) is transformers.Mamba2Config
    engine = assert_exact(path)
    assert type(engine.runner.model) is transformers.Mamba2ForCausalLM


def _kernel_in_fla(*args, **kwargs):
    raise RuntimeError("0 active drivers ([]). There should only be one.")


def _as_fla_code(function):
    """`function` recompiled as if it were defined in fla (its frames' module name)."""
    namespace = {"__name__": "fla.ops.gated_delta_rule.chunk"}
    return type(function)(function.__code__, namespace, function.__name__)


def test_on_the_cpu_a_layer_routed_to_fla_is_refused_naming_it(zoo_dir, monkeypatch):
    """Where fla is installed, transformers calls its chunked kernel for CPU tensors too, and Triton fails
    deep inside (stood in for here by a function whose frames are fla's): construction says why instead."""
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", _as_fla_code(_kernel_in_fla))
    with pytest.raises(ValueError, match=r"'qwen3_5_text' cannot run on the CPU here: flash-linear-attention"):
        make_engine(zoo_dir("qwen3_5_text"))


def test_an_error_raised_elsewhere_is_not_blamed_on_fla(zoo_dir, monkeypatch):
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", _kernel_in_fla)
    with pytest.raises(RuntimeError, match="0 active drivers"):
        make_engine(zoo_dir("qwen3_5_text"))


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed")
@pytest.mark.parametrize("name", ["qwen3_5_text", "mamba2"])
def test_with_fla_installed(zoo_dir, name):
    """The real package: Qwen3.5 refused on the CPU; Mamba-2 served by transformers' model, exactly."""
    if name == "mamba2":
        importlib.import_module("fla")
        assert type(transformers.AutoConfig.from_pretrained(zoo_dir(name))).__module__.startswith("fla.")
        assert_exact(zoo_dir(name), device="cuda" if ON_GPU else "cpu")
    else:
        with pytest.raises(ValueError, match="cannot run on the CPU here: flash-linear-attention"):
            make_engine(zoo_dir(name))


def _logprobs(model, ids: torch.Tensor, piece: int) -> torch.Tensor:
    """Each position's logprobs with `ids` fed `piece` tokens a call through the model's cache (`cache` from
    transformers 5.24; `past_key_values`, deprecated there, goes in 5.40)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, out = None, []
    for start in range(0, ids.shape[1], piece):
        result = model(ids[:, start:start + piece], use_cache=True, **{name: cache})
        cache = result[name]
        out.append(torch.log_softmax(result.logits[0].double(), -1))
    return torch.cat(out)


def _use_torch_rules(model, monkeypatch) -> None:
    """Point the model's module functions that route to fla at transformers' PyTorch references instead."""
    module = sys.modules[type(model.model.layers[0]).__module__]
    for name, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__wrapped__", None) is not None and "delta" in name:
            monkeypatch.setattr(module, name, inspect.unwrap(value))


@pytest.mark.skipif(HAS_FLA and not ON_GPU, reason="fla's kernels need a GPU")
@pytest.mark.parametrize("name", list(FLA_FAMILIES))
def test_the_model_alone_gives_one_answer_fed_whole_or_in_pieces(tmp_path, monkeypatch, name):
    """What the engine test below takes for granted, on transformers' model alone (fla's kernels on the card,
    IEEE float32, where fla is installed; its PyTorch reference elsewhere): a prompt fed whole and fed 16
    tokens a call through its cache, as the engine prefills, give each position the same logprobs, and where
    fla runs, so does the PyTorch reference. A failure here is the model code's or fla's, not the engine's."""
    device = "cuda" if ON_GPU else "cpu"
    model = hf_model(build_zoo_model(name, tmp_path, **FLA_FAMILIES[name])).to(device)
    ids = torch.tensor([prompts_of(LENGTHS)[LENGTHS.index(40)]], device=device)
    with torch.no_grad():
        whole = _logprobs(model, ids, ids.shape[1])
        pieces = _logprobs(model, ids, 16)
        _use_torch_rules(model, monkeypatch)
        reference = _logprobs(model, ids, ids.shape[1])
    assert (pieces - whole).abs().max().item() < 1e-4, "fed in pieces"
    assert (reference - whole).abs().max().item() < 1e-4, "the PyTorch reference"


@pytest.mark.skipif(not (HAS_FLA and ON_GPU), reason="needs flash-linear-attention and a CUDA GPU")
@pytest.mark.parametrize("name", list(FLA_FAMILIES))
def test_fla_kernels_give_transformers_tokens_on_a_gpu(tmp_path, name):
    """Engine and reference both run fla's kernels (float32, on the card, IEEE: `ieee_float32`): forked greedy
    samples, prompts prefilled in chunks, batched decode steps (captured where the model allows) give
    `generate`'s tokens and a plain forward's logprobs within 1e-4."""
    path = build_zoo_model(name, tmp_path, **FLA_FAMILIES[name])
    assert_every_sample_exact(path, n=2, device="cuda", reference_device="cuda")

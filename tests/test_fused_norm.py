"""Fused RMS norms (workers/engine/fused_norm.py): each transformers variant is recognised by running it, its
fused forward equals the module's own, and a module no variant computes keeps its forward; on a GPU compiled
(in bfloat16 too), on the CPU under Triton's interpreter (float32: the interpreter truncates where a GPU rounds
to bfloat16)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import transformers.models.gemma.modeling_gemma as gemma
import transformers.models.kimi_linear.modeling_kimi_linear as kimi_linear
import transformers.models.llama.modeling_llama as llama
import transformers.models.mamba2.modeling_mamba2 as mamba2
import transformers.models.olmo_hybrid.modeling_olmo_hybrid as olmo_hybrid
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
import transformers.models.t5.modeling_t5 as t5

from rollout import SamplingParams
from tests.conftest import ON_GPU, hf_model, make_engine, random_prompts, run
from tests.test_engine_triton import reference_engine
from tests.test_model_coverage import ACCEPTED
from workers.engine import norm_kernel
from workers.engine.fused_norm import MAX_WIDTH, FusedNorm, _inputs, fuse_norms

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton needs CUDA or its interpreter")
DEVICE = "cuda" if ON_GPU else "cpu"
# class, width, (offset, round_first in 16 bits, silu, gated): Llama rounds the normalized input to the model's
# dtype before its weight; Gemma's and Qwen3.5's weights are centred on zero and multiply in float32; OLMo's
# weight multiplies in float32; Qwen3.5's Gated DeltaNet output norm rounds like Llama's, then gates by SiLU;
# Kimi Linear's stays in float32 and gates by a sigmoid
VARIANTS = {
    "llama": (llama.LlamaRMSNorm, 72, (False, True, True, False)),
    "qwen3_5": (qwen3_5.Qwen3_5RMSNorm, 64, (True, False, True, False)),
    "gemma": (gemma.GemmaRMSNorm, 40, (True, False, True, False)),
    "olmo_hybrid": (olmo_hybrid.OlmoHybridRMSNorm, 64, (False, False, True, False)),
    "t5": (t5.T5LayerNorm, 48, (False, True, True, False)),
    "qwen3_5_gated": (qwen3_5.Qwen3_5RMSNormGated, 24, (False, True, True, True)),
    "kimi_gated": (kimi_linear.KimiLinearRMSNormGated, 32, (False, False, False, True)),
}
GATED = (qwen3_5.Qwen3_5RMSNormGated, kimi_linear.KimiLinearRMSNormGated)


class WrongEps(llama.LlamaRMSNorm):
    """A norm whose forward adds another eps than the one it holds: no variant may claim it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + 1e-2)).to(hidden_states.dtype)


class Doubled(llama.LlamaRMSNorm):
    """An RMS norm scaled twice over: no variant may claim it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(hidden_states)


def mamba2_gated_norm(width: int) -> torch.nn.Module:
    """Mamba-2's gated norm: the gate before the norm, over groups of half the width where transformers has
    groups (after 5.17)."""
    groups = "group_size" in inspect.signature(mamba2.MambaRMSNormGated.__init__).parameters
    return mamba2.MambaRMSNormGated(width, **({"group_size": width // 2} if groups else {}))


def norm_model(modules: dict[str, torch.nn.Module], dtype: torch.dtype) -> torch.nn.ModuleDict:
    """The modules with random weights (Gemma's centred on zero), on the device in `dtype`."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(modules).to(DEVICE, dtype)
    with torch.no_grad():
        for module in model.values():
            for param in module.parameters():
                param.copy_(torch.randn_like(param) * 0.3 + 0.9)
    return model


def launches(monkeypatch) -> list[int]:
    """Counts rms_norm calls from here on."""
    calls, kernel = [], norm_kernel.rms_norm
    monkeypatch.setattr(norm_kernel, "rms_norm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def call(module: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return module(x, gate) if isinstance(module, GATED) else module(x)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_each_variant_is_fused_and_equals_its_module(monkeypatch, dtype):
    """Rows of several scales (eps counts at the smallest); in 16 bits the variant of Llama's rounding order is
    told from Gemma's and agrees bit for bit almost everywhere."""
    model = norm_model({name: cls(width) for name, (cls, width, _) in VARIANTS.items()}, dtype)
    want = {}
    for name, module in model.items():
        width = VARIANTS[name][1]
        x = torch.randn(3, 5, width, device=DEVICE) * torch.tensor([1e-3, 1.0, 30.0], device=DEVICE).view(3, 1, 1)
        gate = torch.randn(3, 5, width, device=DEVICE)
        want[name] = (x.to(dtype), gate.to(dtype), call(module, x.to(dtype), gate.to(dtype)))
    fused = fuse_norms(model)
    assert fused == {cls.__name__: 1 for cls, _, _ in VARIANTS.values()}
    calls = launches(monkeypatch)
    for name, module in model.items():
        offset, round_first, silu, gated = VARIANTS[name][2]
        chosen = module.forward
        assert isinstance(chosen, FusedNorm) and (chosen.offset, chosen.gated) == (offset, gated), name
        assert chosen.silu == silu or not gated, name
        x, gate, expected = want[name]
        got = call(module, x, gate)
        assert got.dtype == dtype and got.shape == expected.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert chosen.round_first == round_first, name
            assert (got == expected).float().mean() > 0.99, name
    assert len(calls) == len(VARIANTS)


def test_norms_no_variant_computes_keep_their_forward():
    """Another eps than the one held, a doubled output, a gate before the norm over groups (Mamba2's), a layer
    norm, a norm wider than one program holds: none fused, each still its own forward."""
    model = norm_model({"wrong_eps": WrongEps(32), "doubled": Doubled(32), "layer": torch.nn.LayerNorm(32),
                        "mamba2": mamba2_gated_norm(32), "wide": llama.LlamaRMSNorm(MAX_WIDTH + 1)}, torch.float32)
    assert fuse_norms(model) == {}
    assert all("forward" not in vars(module) for module in model.values())


def test_calls_it_was_not_verified_for_take_the_module_forward(monkeypatch):
    """Another dtype than the weight's, or the gated norm without its gate: the module's own computation."""
    model = norm_model({"llama": llama.LlamaRMSNorm(16), "gated": qwen3_5.Qwen3_5RMSNormGated(16)}, torch.float32)
    fuse_norms(model)
    calls = launches(monkeypatch)
    x = torch.randn(4, 16, device=DEVICE, dtype=torch.float64)
    weight = model["llama"].weight.double()
    assert torch.allclose(model["llama"](x), weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with pytest.raises(TypeError):
        model["gated"](x.float())  # transformers' forward needs its gate, as before
    assert calls == []


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_family_forward_is_unchanged_by_fusing_its_norms(zoo_dir, name):
    """Each accepted family's transformers forward, before and after `fuse_norms`: logits within 1e-4, and every
    plain RMS norm fused (gated ones may keep their forward: Mamba-2's gates before it)."""
    model = hf_model(zoo_dir(name)).to(DEVICE)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        want = model(ids).logits
        plain = {key for key, module in model.named_modules()
                 if _inputs(module) and type(module).__name__.endswith("RMSNorm")}
        fuse_norms(model)
        got = model(ids).logits
    assert plain == {key for key in plain if isinstance(vars(model.get_submodule(key)).get("forward"), FusedNorm)}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_weight_update_reaches_the_fused_norms(model_dir):
    """New weights whose norms differ (each weight scaled by 1 +- 0.5 at random): the Triton engine, its norms
    fused and its decode steps through the static-buffer path, gives the torch engine's tokens and logprobs
    after the update (a fused norm reading its old weight would not)."""
    path = model_dir("qwen3")
    gen = torch.Generator().manual_seed(0)
    state = {key: value * (1 + 0.5 * torch.randn(value.shape, generator=gen)) if key.endswith("norm.weight")
             else value for key, value in hf_model(path).state_dict().items()}
    prompts, params = random_prompts(3, 512, (5, 20), seed=7), SamplingParams(temperature=0, max_new_tokens=5)
    rows = {}
    for backend, engine in (("torch", reference_engine(path, device=DEVICE)),
                            ("triton", make_engine(path, attention_backend="triton", cuda_graphs=(False, True),
                                                   device=DEVICE))):
        engine.update_weights(state, version=1)
        rows[backend] = run(engine, prompts, params)
    assert engine.runner.fused_norms == {"Qwen3RMSNorm": 9}
    for key, want in rows["torch"].items():
        assert rows["triton"][key]["token_ids"] == want["token_ids"]
        assert rows["triton"][key]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)

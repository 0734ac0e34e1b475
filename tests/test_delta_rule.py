"""The in-place Gated DeltaNet decode (workers/engine/delta_rule.py): the kernels equal transformers' own rule
and convolution update on gathered states, write only the rows' slots, and the engine's hybrids stay exact
through them (forks, preemption, padded decode graphs), on a GPU compiled and on the CPU under Triton's
interpreter."""

from __future__ import annotations

import os

import pytest
import torch
import transformers.models.mamba2.modeling_mamba2 as mamba2
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

from tests.conftest import ON_GPU
from tests.test_recurrent import MODEL, assert_every_sample_exact
from workers.engine.delta_rule import InPlace, SlotState, SlotWindow, install_in_place

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton needs CUDA or its interpreter")
DEVICE = "cuda" if ON_GPU else "cpu"
# families whose layers call transformers' gated delta rule: all five on a GPU, three under the interpreter
# (Qwen3.5; OLMo hybrid, with its own projections and doubled beta; Qwen3-Next, whose MoE flags reach the rule)
DELTA_FAMILIES = [MODEL, "olmo_hybrid", "qwen3_next"] + (["qwen3_5_moe_text", "lara_mini"] if ON_GPU else [])
SLOTS, ZERO = 8, 7


def rule() -> InPlace:
    """transformers' rule as Qwen3.5's layers call it in an engine's process: wrapped."""
    install_in_place(qwen3_5.Qwen3_5GatedDeltaNet)
    return qwen3_5.torch_recurrent_gated_delta_rule


def conv_update() -> InPlace:
    """transformers' `causal_conv1d_update` as Qwen3.5's layers call it in an engine's process: wrapped."""
    install_in_place(qwen3_5.Qwen3_5GatedDeltaNet)
    return qwen3_5.causal_conv1d_update


def inputs(kv_heads: int, heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k `[5, 1, kv_heads, 24]`, v `[5, 1, heads, V]`, g, beta `[5, 1, heads]` and states `[8, heads, 24, V]`
    (slot 7 zero), V = BLOCK_V + 8: neither width a power of two, the values two of the kernel's tiles."""
    from workers.engine.delta_rule_kernel import BLOCK_V  # Triton: imported where the module's skip let it be
    gen, width = torch.Generator().manual_seed(seed), BLOCK_V + 8
    q, k = (torch.randn(5, 1, kv_heads, 24, generator=gen) for _ in range(2))
    v = torch.randn(5, 1, heads, width, generator=gen)
    g, beta = -torch.rand(5, 1, heads, generator=gen), torch.rand(5, 1, heads, generator=gen)
    states = torch.randn(SLOTS, heads, 24, width, generator=gen)
    states[ZERO] = 0
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, states))


@pytest.mark.parametrize("kv_heads, heads", [(2, 4), (4, 4)], ids=["grouped", "equal"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_the_kernel_equals_the_rule_on_gathered_states(kv_heads, heads, l2norm):
    """Rows 0-4 live in slots 3, 0, 5, 1, 6; rows 1 and 4 start afresh (they read the zero slot)."""
    q, k, v, g, beta, states = inputs(kv_heads, heads)
    rows = torch.tensor([3, 0, 5, 1, 6], device=DEVICE)
    sources = torch.tensor([3, ZERO, 5, 1, ZERO], device=DEVICE)
    group = heads // kv_heads
    want_out, want_states = rule()(q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v, g=g, beta=beta,
                                   initial_state=states[sources], output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2norm)
    before = states.clone()
    out, handle = rule()(q, k, v, g=g, beta=beta, initial_state=SlotState(states, sources, rows),
                         output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert isinstance(handle, SlotState)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[rows], want_states, rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(SLOTS) if s not in rows.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_a_call_the_kernel_does_not_know_takes_the_rules_own_path(caplog):
    """An unknown argument: the states are gathered for the rule, which returns new ones; no slot is written,
    and the lost saving is logged."""
    q, k, v, g, beta, states = inputs(4, 4)
    rows = torch.arange(5, device=DEVICE)
    before = states.clone()
    calls = []

    def own_rule(*args, initial_state, **kwargs):
        calls.append(kwargs)
        return args[2], initial_state + 1

    out, new = InPlace(own_rule)(q, k, v, g=g, beta=beta, initial_state=SlotState(states, rows, rows),
                                 output_final_state=True, scale=0.5)
    assert calls[0]["scale"] == 0.5 and out is v
    assert torch.equal(new, before[:5] + 1) and torch.equal(states, before)
    assert "('scale',) unknown" in caplog.text


def test_only_layers_that_call_the_rule_get_it_wrapped():
    """Mamba-2's mixer calls `causal_conv1d_update` too, but no gated delta rule: nothing of it is wrapped."""
    assert install_in_place(qwen3_5.Qwen3_5GatedDeltaNet) == {"recurrent", "conv"}
    wrapped = qwen3_5.torch_recurrent_gated_delta_rule, qwen3_5.causal_conv1d_update
    assert all(isinstance(f, InPlace) for f in wrapped) and install_in_place(qwen3_5.Qwen3_5GatedDeltaNet)
    assert (qwen3_5.torch_recurrent_gated_delta_rule, qwen3_5.causal_conv1d_update) == wrapped  # once
    assert not install_in_place(mamba2.Mamba2Mixer)
    assert not isinstance(mamba2.causal_conv1d_update, InPlace)


def windows(channels: int, width: int) -> tuple[torch.Tensor, ...]:
    """x `[5, channels, 1]` (a transposed view, as the layers pass it), weight `[channels, 4]`, bias and
    windows `[8, channels, width]` (slot 7 zero)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 1, channels, generator=gen).transpose(1, 2)
    weight, bias = torch.randn(channels, 4, generator=gen), torch.randn(channels, generator=gen)
    states = torch.randn(SLOTS, channels, width, generator=gen)
    states[ZERO] = 0
    return tuple(t.to(DEVICE) for t in (x, weight, bias, states))


@pytest.mark.parametrize("width", [4, 6])
@pytest.mark.parametrize("activation, with_bias", [("silu", True), (None, False)])
def test_the_conv_kernel_equals_transformers_update_on_gathered_windows(monkeypatch, width, activation, with_bias):
    """Rows 0-4 in slots 3, 0, 5, 1, 6, rows 1 and 4 afresh; 200 channels, two tiles of the kernel; windows as
    wide as the kernel (transformers' cache) and wider."""
    from workers.engine import delta_rule_kernel
    launches = []
    kernel = delta_rule_kernel.short_conv_decode
    monkeypatch.setattr(delta_rule_kernel, "short_conv_decode", lambda *a: launches.append(1) or kernel(*a))
    x, weight, bias, states = windows(200, width)
    bias = bias if with_bias else None
    rows = torch.tensor([3, 0, 5, 1, 6], device=DEVICE)
    sources = torch.tensor([3, ZERO, 5, 1, ZERO], device=DEVICE)
    want_states = states[sources]
    want_out = conv_update()(x, want_states, weight, bias, activation)
    before = states.clone()
    out = conv_update()(x, SlotWindow(states, sources, rows), weight, bias=bias, activation=activation)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[rows], want_states, rtol=0, atol=0)
    assert launches == [1]
    untouched = [s for s in range(SLOTS) if s not in rows.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_a_conv_call_the_kernel_does_not_know_takes_the_functions_own_path(caplog):
    """An argument the kernel does not take: the function updates gathered windows, written back to the rows'
    slots, and the lost saving is logged."""
    x, weight, bias, states = windows(8, 4)
    rows, sources = torch.tensor([2, 4], device=DEVICE), torch.tensor([2, ZERO], device=DEVICE)

    def own_update(hidden_states, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
        conv_state += 1
        return hidden_states

    before = states.clone()
    out = InPlace(own_update)(x[:2], SlotWindow(states, sources, rows), weight, cache_seqlens=3)
    assert out is not None and torch.equal(out, x[:2])
    assert torch.equal(states[rows], before[sources] + 1)
    assert "['cache_seqlens'] unknown" in caplog.text


@pytest.mark.parametrize("name", DELTA_FAMILIES)
def test_a_hybrid_decodes_its_states_in_place_and_stays_exact(zoo_dir, monkeypatch, name):
    """Greedy samples equal `generate`'s with a plain forward's logprobs, through forks, async batching and
    preemption (a sequence's state goes to the CPU pool and back into whatever slot it gets), and for Qwen3.5
    padded decode graphs (the MoE families take the engine's default there: eager in float32 on a GPU).
    tests/test_engine_triton.py runs Qwen3.5's layers in place without async batching."""
    from workers.engine import delta_rule_kernel
    launches = []
    for kernel_name in ("gated_delta_decode", "short_conv_decode"):
        kernel = getattr(delta_rule_kernel, kernel_name)
        monkeypatch.setattr(delta_rule_kernel, kernel_name,
                            lambda *a, kernel=kernel, name=kernel_name: launches.append(name) or kernel(*a))
    stats = assert_every_sample_exact(zoo_dir(name), n=2, reference_device=DEVICE, attention_backend="triton",
                                      cuda_graphs=(False, True) if name == MODEL else None, async_batching=True,
                                      device=DEVICE, num_blocks=12, cpu_offload_gib=0.5)
    assert set(launches) == {"gated_delta_decode", "short_conv_decode"} and stats["restores"] > 0

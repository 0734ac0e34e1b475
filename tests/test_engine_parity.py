"""Greedy output equals transformers' `generate` token for token; logprobs equal a plain forward."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import ON_GPU, hf_model, make_engine, random_prompts, run

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def references(model_dir):
    """Per (arch, device): the prompts and `model.generate`'s greedy continuations (eos stops them)."""
    cache = {}

    def get(arch: str, device: str = "cpu"):
        if (arch, device) not in cache:
            path = model_dir(arch)
            model = hf_model(path).to(device)
            prompts = random_prompts(16, model.config.vocab_size, (1, 40), seed=len(arch))
            outs = []
            for p in prompts:
                ids = model.generate(torch.tensor([p], device=device), max_new_tokens=MAX_NEW, do_sample=False)
                outs.append(ids[0, len(p):].tolist())
            cache[(arch, device)] = (path, prompts, outs)
        return cache[(arch, device)]

    return get


def strip_after_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def assert_greedy_parity(engine, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The engine's greedy samples are `generate`'s tokens, and every prompt token was prefilled or cached."""
    rows = run(engine, prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    eos = next(iter(engine.eos_token_ids))
    for i, want in enumerate(expected):
        assert rows[(i, 0)]["token_ids"] == strip_after_eos(want, eos), f"prompt {i}"
    stats = engine.stats()
    assert stats["prefill_tokens"] + stats["cached_prefix_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_greedy_matches_generate(references, arch, block_size):
    path, prompts, expected = references(arch)
    engine = make_engine(path, block_size=block_size, num_blocks=4096 // block_size, max_batch_tokens=48)
    assert_greedy_parity(engine, prompts, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate_through_decode_graphs(references, arch):
    """Decode steps through the padded static-buffer path of decode graphs (run eagerly on the CPU)."""
    path, prompts, expected = references(arch)
    engine = make_engine(path, num_blocks=256, max_batch_tokens=48, cuda_graphs=(False, True))
    assert_greedy_parity(engine, prompts, expected)
    assert engine.runner.graphs.replays >= MAX_NEW - 1


@pytest.mark.parametrize("arch, graphs", [("llama", False), ("gemma2", True)])
def test_greedy_matches_generate_with_async_batching(references, arch, graphs):
    """Each step's inputs take the tokens of the step before on the device, not from the host; with decode
    graphs too (both are on by default on CUDA)."""
    path, prompts, expected = references(arch)
    engine = make_engine(path, num_blocks=256, max_batch_tokens=48, async_batching=True, check_integrity=True,
                         cuda_graphs=(False, graphs))
    assert_greedy_parity(engine, prompts, expected)
    eos = next(iter(engine.eos_token_ids))
    stopped = [strip_after_eos(out, eos) for out in expected]
    early = sum(eos in out and len(out) < MAX_NEW for out in stopped)  # the next step ran: one token wasted
    assert engine.stats()["wasted_tokens"] == early
    assert not graphs or engine.runner.graphs.replays >= MAX_NEW - 1


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_matches_generate_on_gpu(references, arch, block_size):
    """float32 on the GPU, through the backend "auto" picks there (Triton unless flash-attn imports)."""
    path, prompts, expected = references(arch, "cuda")
    engine = make_engine(path, device="cuda", block_size=block_size, num_blocks=8192 // block_size,
                         max_batch_tokens=48)
    assert_greedy_parity(engine, prompts, expected)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_is_exercised(references, arch):
    path, prompts, expected = references(arch)
    window = hf_model(path).config.sliding_window
    assert max(len(p) + len(o) for p, o in zip(prompts, expected)) > window + 8
    assert len({tuple(o) for o in expected}) > len(expected) // 2, "continuations are not degenerate"


def reference_logprobs(model, prompt, tokens, params: SamplingParams) -> list[float]:
    """Logprobs of `tokens` from one forward pass, filtered as `params` ask, in plain numpy-like torch."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    out = []
    for row, token in zip(logits, tokens):
        if params.logprobs_mode == "raw" or params.temperature == 0:
            out.append(torch.log_softmax(row, -1)[token].item())
            continue
        probs = exact_distribution(row, params)
        out.append(torch.log(probs[token]).item())
    return out


def exact_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution after temperature, top-k, top-p, min-p: an independent, sorted-list version."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = order[: p.top_k] if p.top_k else order
    total = probs[keep].sum().item()
    mass, kept = 0.0, []
    for i in keep:
        if mass >= p.top_p * total:
            break
        kept.append(i)
        mass += probs[i].item()
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    if p.min_p:
        out[out < p.min_p * out.max()] = 0
        out /= out.sum()
    return out


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_logprobs_match_forward(model_dir, arch, mode):
    path = model_dir(arch)
    model = hf_model(path)
    prompts = random_prompts(6, model.config.vocab_size, (3, 30), seed=7)
    params = [SamplingParams(temperature=0, max_new_tokens=12, logprobs_mode=mode),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=12, seed=3, logprobs_mode=mode),
              SamplingParams(temperature=1.3, min_p=0.05, max_new_tokens=12, seed=4, logprobs_mode=mode)] * 2
    rows = run(make_engine(path, block_size=8, max_batch_tokens=32), prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        row = rows[(i, 0)]
        want = reference_logprobs(model, prompt, row["token_ids"], p)
        assert row["logprobs"] == pytest.approx(want, abs=1e-4), f"prompt {i} {p}"

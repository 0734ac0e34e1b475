"""Per-row temperature, top-k, top-p, min-p and greedy sampling with counter-based noise.

Each row draws one uniform number from a hash of (seed, prompt hash, sample index, position) and
inverts the CDF of its filtered distribution, so a seeded sample is the same whatever shares its
batch, and whether or not it was preempted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.sequence import Sequence

_M64 = 0xFFFFFFFFFFFFFFFF


def _mix(x: int | np.ndarray) -> int | np.ndarray:
    """splitmix64 finaliser: a bijective scramble of 64-bit counters (Python ints or uint64 arrays)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=1 << 16)
def sample_key(seed: int, prompt_hash: int, sample_index: int) -> int:
    """The noise key of one sample: its seed, prompt and index mixed once, not in every step."""
    return _mix(_mix(_mix(seed) ^ prompt_hash) ^ sample_index)


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of its sample key and position (uint64)."""
    with np.errstate(over="ignore"):
        h = _mix(keys ^ positions)
    return (h >> 11).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class SamplingFlags:
    """What a step's rows ask for, known on the host, so the sampler never reads a device flag."""

    scale: bool  # some row has a temperature other than 0 and 1
    max_top_k: int  # largest top_k of the step (0 = no row filters by top-k)
    top_k1: bool  # some row has top_k == 1: exactly greedy
    top_p: bool
    min_p: bool
    all_greedy: bool
    any_greedy: bool
    any_raw: bool  # some row reports the model's own logprob


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device, and host flags."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    uniform: torch.Tensor  # [B] float64
    raw_logprobs: torch.Tensor  # [B] bool: report the model's own logprob
    flags: SamplingFlags


def filtered_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Logits after temperature, top-k, top-p and min-p (in that order); removed tokens are -inf.
    A row with top_k == 1 keeps only its argmax (the lowest index among tied maxima)."""
    x, f = logits, b.flags
    if f.scale:
        x = x / torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))[:, None]
    vocab = x.shape[-1]
    if f.max_top_k:
        top = torch.topk(x, min(f.max_top_k, vocab), dim=-1).values
        kth = top.gather(1, (b.top_k.clamp(1, top.shape[1]) - 1)[:, None])
        x = x.masked_fill((x < kth) & (b.top_k > 0)[:, None], float("-inf"))
    if f.top_k1:
        others = torch.arange(vocab, device=x.device)[None, :] != x.argmax(dim=-1, keepdim=True)
        x = x.masked_fill(others & (b.top_k == 1)[:, None], float("-inf"))
    if f.top_p:
        # stable: tied tokens keep their index order, so the same ones pass top-p in any batch (CUDA's sort is not)
        probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True, stable=True)
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = (before >= b.top_p[:, None]) & (b.top_p < 1)[:, None]  # float32 sums reach 1 early
        x = x.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    if f.min_p:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def sample(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens `[B]` and the logprob of each under the requested mode (greedy rows report raw)."""
    logits, f = logits.float(), b.flags
    if f.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _raw_logprobs(logits, tokens)
    probs = torch.softmax(filtered_logits(logits, b), dim=-1)
    tokens = inverse_cdf(probs, b.uniform)
    greedy = b.temperature == 0
    if f.any_greedy:
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = probs.gather(1, tokens[:, None])[:, 0].log()
    if f.any_raw or f.any_greedy:
        chosen = torch.where(b.raw_logprobs | greedy, _raw_logprobs(logits, tokens), chosen)
    return tokens, chosen


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, width: int = 64) -> torch.Tensor:
    """The token where each row's CDF first exceeds `uniform` times its total mass.

    Two levels instead of one cumsum over the vocabulary: pick the chunk of `width` tokens from the
    chunk sums, then the token inside it, so only one full pass reads the probabilities.
    """
    rows, vocab = probs.shape
    if vocab % width:
        probs = torch.nn.functional.pad(probs, (0, -vocab % width))
    chunks = probs.view(rows, -1, width)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)
    target = uniform[:, None] * chunk_cdf[:, -1:]
    j = torch.searchsorted(chunk_cdf, target, right=True).clamp(max=chunk_cdf.shape[1] - 1)
    before = torch.where(j > 0, chunk_cdf.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    frac = ((target - before) / (chunk_cdf.gather(1, j) - before)).clamp(0, 1 - 2**-40)
    inner = chunks[torch.arange(rows, device=probs.device), j[:, 0]].double().cumsum(dim=-1)
    k = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp(max=width - 1)
    return (j * width + k)[:, 0]


def _raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return (logits.gather(1, tokens[:, None]) - torch.logsumexp(logits, dim=-1, keepdim=True))[:, 0]


class RowParams:
    """Each block-table row's sampling values and noise key, written when a sequence takes the row:
    a step whose sequences are all single samples gathers them by row instead of reading each one."""

    def __init__(self, max_rows: int) -> None:
        self.values = np.zeros((max_rows, 5))
        self.keys = np.zeros(max_rows, np.uint64)

    def write(self, seq: Sequence) -> None:
        """Record the parameters of `seq` (of its first sample: an unforked prompt keeps that one)."""
        group = seq.group
        self.values[seq.row] = group.sampling_values
        self.keys[seq.row] = sample_key(group.seed, group.prompt_hash, group.noise_index(seq.sample_indices[0]))


def expanded_rows(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values, noise keys and logits row of each wanted sample of each of `seqs` (an unforked prompt
    has one row per sample, all reading its logits)."""
    rows = [(i, seq, index) for i, seq in enumerate(seqs) for index in seq.sample_indices]
    values = np.array([seq.group.sampling_values for _, seq, _ in rows], np.float64).reshape(-1, 5)
    keys = np.array([sample_key(seq.group.seed, seq.group.prompt_hash, seq.group.noise_index(index))
                     for _, seq, index in rows],
                    np.uint64)
    return values, keys, np.array([i for i, _, _ in rows], np.int64)


def sampling_arrays(values: np.ndarray, keys: np.ndarray,
                    positions: np.ndarray) -> tuple[dict[str, np.ndarray], SamplingFlags]:
    """Per-row parameters (`values` as in `Group.sampling_values`) and counter-based uniforms keyed by
    (sample key, position), as host arrays for the step's one copy, and the flags the sampler takes
    its path from."""
    arrays = {"temperature": values[:, 0].astype(np.float32), "top_k": values[:, 1].astype(np.int64),
              "top_p": values[:, 2].astype(np.float32), "min_p": values[:, 3].astype(np.float32),
              "uniform": uniforms(keys, positions.astype(np.uint64)), "raw_logprobs": values[:, 4] != 0}
    return arrays, _flags(values)


def _flags(values: np.ndarray) -> SamplingFlags:
    """The flags of rows `values`, from their distinct parameter sets (usually one per step)."""
    same = values.size == 0 or bool((values == values[0]).all())
    distinct = set(map(tuple, (values[:1] if same else values).tolist()))
    greedy = [v[0] == 0 for v in distinct]
    return SamplingFlags(scale=any(v[0] not in (0, 1) for v in distinct),
                         max_top_k=int(max((v[1] for v in distinct), default=0)),
                         top_k1=any(v[1] == 1 for v in distinct), top_p=any(v[2] < 1 for v in distinct),
                         min_p=any(v[3] > 0 for v in distinct), all_greedy=all(greedy), any_greedy=any(greedy),
                         any_raw=any(v[4] != 0 for v in distinct))


def sampling_batch(tensors: dict[str, torch.Tensor], flags: SamplingFlags) -> SamplingBatch:
    """The SamplingBatch of a step from its device tensors (named as in `sampling_arrays`)."""
    names = ("temperature", "top_k", "top_p", "min_p", "uniform", "raw_logprobs")
    return SamplingBatch(*(tensors[name] for name in names), flags=flags)

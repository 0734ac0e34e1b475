"""Triton paged-attention kernels against the torch reference.

Without a GPU (CI) the kernels run on CPU in Triton's interpreter (TRITON_INTERPRET=1, set here),
in float32 and float16. With CUDA they are compiled and run on the GPU, bfloat16 included.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.conftest import ON_GPU

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # forced, unlike conftest's default: these tests need it

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.paged_cases import assert_matches_reference, random_step  # noqa: E402
from workers.engine.attention import triton_kernels  # noqa: E402
from workers.engine.attention.base import AttentionMetadata  # noqa: E402
from workers.engine.attention.torch_backend import TorchBackend, store_kvcache  # noqa: E402
from workers.engine.attention.triton_backend import (  # noqa: E402
    TritonBackend,
    choose_num_splits,
)
from workers.engine.kv_cache import KvCache  # noqa: E402

if not ON_GPU and not isinstance(tl.sum, InterpretedFunction):
    # Triton was imported (by torch._dynamo, through conftest) before TRITON_INTERPRET was set:
    # re-decorate triton.language's own jit functions and our kernels for the interpreter.
    importlib.reload(tl.standard)
    importlib.reload(tl)
    importlib.reload(triton_kernels)

DEVICE = "cuda" if ON_GPU else "cpu"


def run_both(pairs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int,
             dtype: torch.dtype, window: int | None, softcap: float | None, splits: int | None,
             pad_tokens: int = 0, num_sms: int | None = None, sinks: bool = False, v_dim: int | None = None) -> None:
    """One layer through TritonBackend (in `dtype`) against the torch reference; `splits` None lets
    the heuristic choose (and it must split); `num_sms` pretends a GPU size; `sinks` adds attention sinks;
    `v_dim` makes the values the keys' first columns (latent attention)."""
    meta, cache, q, k, v = random_step(pairs, heads, head_dim, block_size, pad_tokens, DEVICE, dtype, v_dim=v_dim)
    backend = TritonBackend(KvCache.of(cache), splits)
    backend.num_sms = num_sms or backend.num_sms
    sink_logits = torch.randn(heads[0], generator=torch.Generator().manual_seed(5)).to(DEVICE) * 3 if sinks else None
    assert_matches_reference(backend, meta, q, k, v, window, softcap, sink_logits)
    if splits is None:
        assert backend.num_splits > 1


MIXED = [(1, 1328), (5, 18), (129, 463), (1, 1), (7, 7), (0, 0), (1, 70)]
DECODES = [(1, 1328), (1, 18), (1, 463), (1, 1), (0, 0)]


@pytest.mark.parametrize(
    "dtype, heads, head_dim, block_size, window, softcap, splits",
    [
        (torch.float32, (4, 4), 64, 16, None, None, 1),
        (torch.float16, (8, 2), 128, 256, 100, None, 1),
        (torch.float32, (5, 1), 128, 16, None, 5.0, 4),
        (torch.float16, (4, 4), 128, 16, 100, 5.0, 2),
        (torch.float32, (8, 2), 64, 256, 100, 5.0, 4),
        (torch.float16, (5, 1), 64, 256, None, None, 1),
        (torch.float16, (8, 2), 64, 16, None, 5.0, 1),
        (torch.float32, (5, 1), 64, 16, 100, None, 2),
        (torch.float32, (4, 4), 128, 256, None, 5.0, 4),
        (torch.float16, (5, 1), 128, 16, 100, 5.0, 1),
        (torch.float16, (4, 4), 64, 256, 100, None, 4),
        (torch.float32, (8, 2), 128, 16, None, None, 2),
        (torch.float16, (8, 1), 512, 16, None, None, 1),  # Gemma 4's global layers: 32-row mixed tiles
    ])
def test_mixed_batch_matches_reference(dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                                       block_size: int, window: int | None, softcap: float | None,
                                       splits: int) -> None:
    """Prefill chunks, fresh prompts, decodes and an empty sequence in one packed step."""
    run_both(MIXED, heads, head_dim, block_size, dtype, window, softcap, splits, pad_tokens=3)


@pytest.mark.parametrize(
    "dtype, heads, head_dim, block_size, window, softcap",
    [
        (torch.float16, (8, 2), 64, 16, None, 5.0),
        (torch.float32, (5, 1), 128, 256, 300, None),
        (torch.float16, (4, 4), 64, 16, 100, None),
        (torch.float32, (4, 4), 128, 16, None, None),
        (torch.float16, (5, 1), 64, 256, 100, 5.0),
        (torch.float32, (8, 2), 128, 256, None, None),
        (torch.float16, (8, 1), 512, 16, None, None),
    ])
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_matches_reference(dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                                  block_size: int, window: int | None, softcap: float | None,
                                  splits: int) -> None:
    """A decode-only step (one-token tiles) with a padding sequence, single-pass and split-KV."""
    run_both(DECODES, heads, head_dim, block_size, dtype, window, softcap, splits, pad_tokens=2)


@pytest.mark.parametrize("pairs", [MIXED, DECODES], ids=["mixed", "decode"])
@pytest.mark.parametrize("splits", [1, 4])
def test_attention_sinks_match_reference(pairs: list[tuple[int, int]], splits: int) -> None:
    """A sink logit per query head joins the softmax once: in the single pass, or in the split merge."""
    run_both(pairs, (8, 2), 64, 16, torch.float32, 100, None, splits, pad_tokens=2, sinks=True)


@pytest.mark.parametrize("pairs, heads, dims, splits", [
    (MIXED, (4, 1), (20, 16), 1),  # the test models' latent: a 4-wide key tail
    (DECODES, (4, 1), (20, 16), 4),
    (DECODES, (32, 1), (576, 512), 1),  # DeepSeek's latent widths, 32 heads: two programs of 16 heads each
    (DECODES, (32, 1), (576, 512), 8),
    ([(3, 40), (1, 17), (0, 0)], (32, 1), (576, 512), 1),
])
def test_latent_attention_matches_reference(pairs: list[tuple[int, int]], heads: tuple[int, int],
                                            dims: tuple[int, int], splits: int) -> None:
    """One latent head whose values are its keys' first columns, read once from a one-plane cache."""
    run_both(pairs, heads, dims[0], 16, torch.float32, None, None, splits, pad_tokens=2, v_dim=dims[1])


def test_split_count_counts_a_latent_heads_query_slices() -> None:
    """A latent head's 32 query heads run as two programs per sequence (16 heads each): once a forward has
    shown that, a decode of 140 sequences on 132 SMs (280 programs) splits its keys in two, for about the
    8 wide programs per SM aimed at; counted by KV heads alone (140 programs) it would split them in four."""
    seqs = 140
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(seqs, dtype=torch.int64, device=DEVICE),
        cu_seqlens_q=torch.arange(seqs + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((seqs,), 1024, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(seqs, 64, dtype=torch.int32, device=DEVICE), max_seqlen_q=1, max_seqlen_k=1024)
    backend = TritonBackend(KvCache.of(torch.zeros(1, 1, 1, 16, 1, 576, device=DEVICE)))
    backend.num_sms = 132
    backend.prepare_metadata(meta)
    assert backend.wide_heads and backend.num_splits == 4
    q, k = torch.zeros(0, 32, 576, device=DEVICE), torch.zeros(0, 1, 576, device=DEVICE)
    backend.forward(0, q, k, k[..., :512], 1.0, None, None)  # no tokens: the launch configuration only
    backend.prepare_metadata(meta)
    assert backend.programs_per_seq == 2 and backend.num_splits == 2


def test_split_path_chosen_in_prepare_metadata() -> None:
    """With few decodes over a long context the heuristic splits the keys, and still matches."""
    run_both([(1, 1328), (1, 700)], (8, 2), 64, 16, torch.float32, None, None, None, num_sms=132)


@pytest.mark.skipif(not ON_GPU, reason="Triton's interpreter mishandles bfloat16")
@pytest.mark.parametrize("pairs", [MIXED, DECODES])
@pytest.mark.parametrize("splits", [1, 4])
def test_bfloat16_on_gpu(pairs: list[tuple[int, int]], splits: int) -> None:
    """The compiled kernels in bfloat16 (GPU only), with window and softcap on and off."""
    run_both(pairs, (8, 2), 128, 16, torch.bfloat16, None, None, splits, pad_tokens=3)
    run_both(pairs, (5, 1), 64, 256, torch.bfloat16, 100, 5.0, splits, pad_tokens=3)


def test_choose_num_splits() -> None:
    """Split only decode steps that leave the GPU idle, bounded by context length and MAX_SPLITS."""
    assert choose_num_splits(64, 8, 1, 8192, 132) == 1
    assert choose_num_splits(4, 8, 2, 8192, 132) == 1
    assert choose_num_splits(4, 8, 1, 8192, 132) == 16
    assert choose_num_splits(4, 8, 1, 1024, 132) == 4
    assert choose_num_splits(4, 8, 1, 300, 132) == 1
    assert choose_num_splits(16, 8, 1, 8192, 132) == 4


@pytest.mark.parametrize("seqs, programs_per_seq, context, splits", [
    (64, 1, 4096, 16), (128, 1, 4096, 8), (256, 1, 4096, 4), (512, 1, 4096, 2), (1024, 1, 4096, 1),
    (64, 1, 1024, 4), (64, 8, 4096, 2), (8, 1, 300, 1)])
def test_wide_heads_aim_at_eight_programs_per_sm(seqs, programs_per_seq, context, splits) -> None:
    """A cached latent's decode (one wide KV head, or DeepSeek-V3's 8 slices of query heads) is split into
    about 8 programs per SM, rounded down, where narrow heads of 256 sequences would not split at all."""
    assert choose_num_splits(seqs, programs_per_seq, 1, context, 132, True) == splits
    assert choose_num_splits(seqs, programs_per_seq, 2, context, 132, True) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_skips_padding_slots(dtype: torch.dtype) -> None:
    """The store kernel writes exactly what the torch reference writes, skipping slots < 0."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 16, 3, 80, generator=gen).to(DEVICE, dtype)
    k, v = torch.randn(2, 9, 3, 80, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([5, -1, 17, 18, 95, -1, 0, 40, -1], dtype=torch.int64, device=DEVICE)
    expected = cache.clone()
    store_kvcache(k, v, expected[0], expected[1], slots)
    triton_kernels.store_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


class LaunchRecorder:
    """Stands in for a jitted kernel: runs each launch and logs (kernel, grid, args, kwargs)."""

    def __init__(self, kernel, log: list) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs):
            self.log.append((self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


GRAPH_STEPS = {  # two steps per case with equal shapes (tokens, sequences) and different data
    "mixed": ([(1, 300), (5, 18), (40, 90), (0, 0), (7, 7)],
              [(3, 100), (1, 1), (30, 200), (12, 12), (7, 40)]),
    "decode": ([(1, 700), (1, 18), (1, 1), (0, 0)], [(1, 5), (1, 900), (0, 0), (1, 260)]),
}


@pytest.mark.parametrize("case, splits", [("mixed", 1), ("mixed", 2), ("decode", 1), ("decode", 4)])
def test_launches_replay_like_a_cuda_graph(monkeypatch: pytest.MonkeyPatch, case: str,
                                           splits: int) -> None:
    """What a captured CUDA graph does: the first step's launches (grids, scalar arguments and
    buffers unchanged) replayed after the second step's data is copied into the same buffers give
    the second step's result, so no launch depends on a host integer taken from the data. Decode steps'
    padding tokens (a decode graph's) come out zero, not as what the output held before."""
    log: list = []
    for name in ("_store_kv_kernel", "_paged_attention_kernel", "_merge_splits_kernel"):
        monkeypatch.setattr(triton_kernels, name, LaunchRecorder(getattr(triton_kernels, name), log))
    block_size, steps = 16, GRAPH_STEPS[case]
    blocks = [-(-k // block_size) for pairs in steps for _, k in pairs]
    shape = dict(num_blocks=sum(blocks) + 3, width=max(blocks))
    first, second = (random_step(p, (8, 2), 64, block_size, 2, DEVICE, torch.float32, **shape)
                     for p in steps)
    captured = TritonBackend(KvCache.of(first[1]), splits)
    captured.prepare_metadata(first[0])
    captured.forward(1, *first[2:], 0.125, 50, 5.0)
    for buffers in ((first[0], second[0]), *zip(first[1:], second[1:])):
        _copy_into(*buffers)
    reference = TorchBackend(KvCache.of(second[1].clone()))
    reference.prepare_metadata(second[0])
    expected = reference.forward(1, *second[2:], 0.125, 50, 5.0)
    out, valid = log[1][2][0], int(second[0].cu_seqlens_q[-1])
    out.fill_(float("nan"))  # as a graph's output holds its last replay's values
    for kernel, grid, args, kwargs in log:
        kernel[grid](*args, **kwargs)
    torch.testing.assert_close(out[:valid], expected[:valid], atol=2e-5, rtol=2e-5)
    if case == "decode":
        assert not out[valid:].any(), "a padding token's output is not zeros"
    assert torch.equal(first[1], reference.kv_cache.tensors[0])


def _copy_into(dst, src) -> None:
    """Copy a step's tensors (or metadata's tensor fields) into another step's, in place."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
        return
    for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_table"):
        getattr(dst, name).copy_(getattr(src, name))

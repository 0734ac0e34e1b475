"""No step compiles a Triton kernel: every variant the engine's steps launch was launched at start.

Triton compiles one binary per specialization of a launch: its constexprs, its launch options, and
for each other argument its type, whether an integer equals 1 or is a multiple of 16, and whether a
pointer is 16-byte aligned. On a GPU a new one stalls the step for seconds. Here every launch's key
is computed with Triton's own specialization rules (the kernels run in the interpreter), the launches
of CUDA start-up are replayed (the warm-up step, then each decode graph's warm-up run), and a
workload of prefills of every size, forks, prefix-cache hits, chunked prompts and decodes must then
launch no key outside that set. The step inputs are packed into one staging buffer as on CUDA, so
their alignment is the one the GPU kernels see. With decode graphs off, eager decode steps at every
split count a card of H100_SMS multiprocessors gets must launch only variants compiled at start.
"""

from __future__ import annotations

import os

import pytest
import torch

from rollout import SamplingParams
from tests.conftest import make_engine, random_prompts, run, simulate_sms

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

if hasattr(BaseBackend, "compute_spec_key"):  # Triton 3.2, torch 2.6's
    pytest.skip("this Triton keys launches through a backend instance, not the API Recorder calls",
                allow_module_level=True)

from workers.engine import norm_kernel  # noqa: E402
from workers.engine.attention import AttentionMetadata, triton_kernels  # noqa: E402
from workers.engine.staging import Staging  # noqa: E402

KERNELS = ((triton_kernels, "_store_kv_kernel"), (triton_kernels, "_paged_attention_kernel"),
           (triton_kernels, "_merge_splits_kernel"), (norm_kernel, "_rms_norm_kernel"))
H100_SMS = 132


class Recorder:
    """Stands in for an interpreted kernel: records the specialization key of each launch, then runs it."""

    def __init__(self, kernel, seen: set) -> None:
        self.kernel, self.seen = kernel, seen
        jit = JITFunction(kernel.fn, **kernel.kwargs)
        self.bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs) -> None:
            _, specialization, options = self.bind(*args, **kwargs)
            self.seen.add((self.kernel.__name__, tuple(specialization), tuple(sorted(options.items()))))
            self.kernel[grid](*args, **kwargs)
        return launch


def record_launches(monkeypatch) -> set:
    """The set every kernel launch from now on adds its specialization key to."""
    seen: set = set()
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), seen))
    return seen


def eager_decode(runner, num_seqs: int, max_seqlen_k: int) -> int:
    """Launch an eager decode step with these host scalars (one cached token per sequence, nothing
    written); the split count it chose."""
    zeros = torch.zeros(num_seqs, dtype=torch.int64)
    meta = AttentionMetadata(zeros - 1, torch.arange(num_seqs + 1, dtype=torch.int32),
                             torch.ones(num_seqs, dtype=torch.int32), torch.zeros(num_seqs, 1, dtype=torch.int32),
                             max_seqlen_q=1, max_seqlen_k=max_seqlen_k, ring_slot_mapping=zeros - 1,
                             ring_block_table=torch.zeros(num_seqs, 1, dtype=torch.int32))
    runner.model_forward(zeros, zeros, meta, 0, None)
    return runner.backend.num_splits


@pytest.mark.parametrize("arch, overrides", [("gemma2", {}), ("qwen3", {"head_dim": 72})], ids=["gemma2", "qwen3-72"])
def test_steps_launch_only_variants_warmed_at_start(model_dir, monkeypatch, arch, overrides):
    """gemma2: sliding and global layers, logit softcap; qwen3 with a head size that is no multiple of 16, so
    strides scaled by a step's token count could change whether an argument is one (Triton specializes on it)."""
    seen = record_launches(monkeypatch)
    engine = make_engine(model_dir(arch, **overrides), attention_backend="triton", cuda_graphs=(False, True),
                         max_num_seqs=8, max_batch_tokens=40, windowed_kv="full")  # full: prefix caching on
    graphs = engine.runner.graphs
    for entry in graphs.graphs.values():  # what capturing each graph launches first on CUDA
        graphs._launch(entry)
    at_start = set(seen)
    assert {kernel for kernel, *_ in at_start} >= {"_store_kv_kernel", "_paged_attention_kernel", "_rms_norm_kernel"}
    engine.runner.staging = Staging(torch.device("cpu"), pack=True)
    prompts = random_prompts(6, 512, (3, 45), seed=3)
    prompts.append(prompts[0][:17] + [5])  # a prefix-cache hit: one prompt token left to compute
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=1)
    run(engine, prompts, params)
    assert graphs.replays > 0
    new = seen - at_start
    assert not new, f"{len(new)} kernel variants first launched after start-up, e.g. {sorted(new)[:2]}"


def test_eager_decodes_launch_only_variants_warmed_at_start(model_dir, monkeypatch):
    """Decode graphs off, on a card of H100_SMS multiprocessors: decodes of every length up to
    max_model_len choose split counts 1 to 16, each compiled at start."""
    seen = record_launches(monkeypatch)
    simulate_sms(monkeypatch, H100_SMS)
    engine = make_engine(model_dir("gemma2", max_position_embeddings=4096), attention_backend="triton",
                         cuda_graphs=(False, False), max_num_seqs=8)
    at_start = set(seen)
    steps = [(1, 1), (5, 511), (1, 512), (5, 1500), (1, 2048), (5, 4096)]  # (sequences, longest)
    splits = {eager_decode(engine.runner, num_seqs, length) for num_seqs, length in steps}
    assert splits == {1, 2, 4, 8, 16}
    new = seen - at_start
    assert not new, f"{len(new)} kernel variants first launched after start-up, e.g. {sorted(new)[:2]}"

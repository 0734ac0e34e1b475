"""The whole engine on the Triton backend (compiled on a GPU, else interpreted on the CPU), its RMS norms
fused, gives the torch backend's tokens on the same device."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from rollout import SamplingParams
from tests.conftest import ON_GPU, make_engine, random_prompts, run
from workers.engine import model_runner
from workers.engine.fused_norm import FusedNorm

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton needs CUDA or its interpreter")


@pytest.mark.parametrize("arch, graphs", [("qwen3", (False, False)), ("mistral", (False, False)),
                                          ("mistral", (False, True))], ids=["qwen3", "mistral", "mistral-graphs"])
def test_triton_engine_matches_torch_engine(model_dir, arch, graphs):
    """Also with decode graphs (captured on a GPU): padded decode steps through the Triton kernels."""
    assert_triton_matches_torch(model_dir(arch), random_prompts(4, 512, (5, 30), seed=40), graphs)


def reference_engine(path: str, **config):
    """The torch backend with transformers' own norms. On CUDA the engine fuses them whatever its attention
    backend (Triton runs there), so a reference of fused norms would share any fault of theirs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "fuse_norms", lambda model: Counter())
        engine = make_engine(path, attention_backend="torch", **config)
    assert not any(isinstance(vars(module).get("forward"), FusedNorm) for module in engine.runner.model.modules())
    return engine


def test_a_linear_attention_hybrid_on_triton_matches_torch(zoo_dir):
    """Qwen3.5's attention layer through the Triton kernels beside its Gated DeltaNet layer's state slots,
    forked samples and padded decode graphs included."""
    assert_triton_matches_torch(zoo_dir("qwen3_5_text"), random_prompts(4, 128, (5, 30), seed=40), (False, True))


def assert_triton_matches_torch(path: str, prompts: list[list[int]], graphs: tuple[bool, bool]) -> None:
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, ignore_eos=True)
    config = dict(block_size=16, max_batch_tokens=32, device="cuda" if ON_GPU else "cpu")
    want = run(reference_engine(path, **config), prompts, params)
    engine = make_engine(path, attention_backend="triton", cuda_graphs=graphs, **config)
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    assert_norms_fused(engine.runner.model)
    got = run(engine, prompts, params)
    assert (engine.runner.graphs.replays > 0) if graphs[1] else engine.runner.graphs is None
    for key in want:
        assert got[key]["token_ids"] == want[key]["token_ids"]
        assert got[key]["logprobs"] == pytest.approx(want[key]["logprobs"], abs=1e-4)


def assert_norms_fused(model) -> None:
    """Every RMS norm module (Gated DeltaNet's gated one included) runs as one kernel."""
    norms = {name for name, module in model.named_modules() if "RMSNorm" in type(module).__name__}
    assert norms and norms == {name for name, module in model.named_modules()
                               if isinstance(vars(module).get("forward"), FusedNorm)}

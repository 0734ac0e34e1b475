"""Decode graphs on the CPU, where `cuda_graphs=(False, True)` runs the padded static-buffer path eagerly:
the buckets, the config field, a replay check at every decode step (the graph of the step's key over
refilled static buffers equals the eager forward of the same inputs, and writes only the step's own
slots), outputs equal to graphs off, and a planted copy of transformers #45323 (a key without the KV
bucket) that the replay check catches."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from rollout import SamplingParams
from rollout.config import EngineConfig, load_service_config
from tests.conftest import make_engine, random_prompts, run, simulate_sms
from tests.model_zoo import build_zoo_model
from workers.engine import graphs, model_runner, warmup
from workers.engine.graphs import batch_buckets, kv_bucket, kv_buckets
from workers.engine.pipeline import Sampled

DECODE_GRAPHS = (False, True)
# Long prompts whose decoding crosses the smallest KV bucket (1024), beside short ones; every sample
# ends at its own length, so a batch shrinks inside a bucket while the others decode.
PROMPTS = random_prompts(2, 512, (1000, 1015), seed=5) + random_prompts(3, 512, (5, 30), seed=6)
PARAMS = [SamplingParams(n=3, temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=20 + 8 * i, seed=i,
                         ignore_eos=True) for i in range(2)] + \
         [SamplingParams(temperature=0, max_new_tokens=10 + 9 * i, ignore_eos=True) for i in range(3)]
ENGINE = dict(max_model_len=2048, num_blocks=1024, max_batch_tokens=512, max_num_seqs=24)


def test_buckets():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, *range(32, 257, 16)]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(3) == [1, 2, 3]
    assert [kv_bucket(n) for n in (1, 1024, 1025, 4096, 4097)] == [1024, 1024, 2048, 4096, 8192]
    assert kv_buckets(1000) == kv_buckets(1024) == [1024]
    assert kv_buckets(1025) == [1024, 2048]
    assert kv_buckets(5000) == [1024, 2048, 4096, 8192]


def test_cuda_graphs_field():
    assert graphs.resolve(EngineConfig(model="m")) == (False, False)
    assert graphs.resolve(EngineConfig(model="m", device="cuda")) == (False, True)
    assert graphs.resolve(EngineConfig(model="m", device="cuda", cuda_graphs=(False, False))) == (False, False)
    assert graphs.resolve(EngineConfig(model="m", cuda_graphs=(False, True))) == (False, True)
    assert graphs.resolve(EngineConfig(model="m", device="cuda", attention_backend="torch")) == (False, False)
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs=\(False, True\) with attention_backend='torch'"):
        EngineConfig(model="m", device="cuda", attention_backend="torch", cuda_graphs=(False, True))
    with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs=\(True, True\): varlen graphs .* not supported"):
        EngineConfig(model="m", cuda_graphs=(True, True))
    for bad in [(True,), (1, 0), [False, True], "on", (False, True, False)]:
        with pytest.raises(ValueError, match=r"EngineConfig.cuda_graphs=.* must be None or a tuple \(varlen, decode\)"):
            EngineConfig(model="m", cuda_graphs=bad)
    from_toml = load_service_config(engine={"model": "m", "cuda_graphs": [False, True]}).engine
    assert from_toml.cuda_graphs == (False, True)


def _waits_on_host(filename: str, inner=None):
    """A function compiled as if from `filename` that raises torch's sync debug error (or calls `inner`)."""
    scope = {"inner": inner}
    body = ("def step():\n"
            "    if inner: inner()\n"
            "    raise RuntimeError('called a synchronizing CUDA operation')\n")
    exec(compile(body, filename, "exec"), scope)
    return scope["step"]


def test_host_sync_names_the_models_line():
    """The error of a decode step that waits on the host names the innermost frame outside torch, and for
    transformers' MoE experts says they stay on the device in bfloat16 only."""
    torch_op = _waits_on_host(str(Path(torch.__file__).parent / "nn" / "functional.py"))
    for path, hint in [("/opt/torch/site/transformers/models/dbrx/modeling_dbrx.py", False),
                       ("/site/transformers/integrations/moe.py", True)]:
        with pytest.raises(RuntimeError, match="synchronizing") as err:
            _waits_on_host(path, inner=torch_op)()
        message = graphs.host_sync_message(err.value)
        assert message.startswith(f"the decode step waits on the host at {Path(path).parent.name}/"
                                  f"{Path(path).name}:2"), message
        assert ("bfloat16 only" in message) == hint


def test_graphs_off_when_the_decode_step_waits_on_the_host(model_dir, monkeypatch):
    """When capture finds a host wait, decode graphs asked for are refused with its line, and graphs left
    to the default are off, decode steps running eagerly with the same outputs (here on the CPU, with the
    capture made to find one, as it does on a GPU for tests/test_model_coverage.py's HOST_SYNC families)."""
    def found(runner):
        raise graphs.HostSync("the decode step waits on the host at dbrx/modeling_dbrx.py:433")
    monkeypatch.setattr(warmup, "DecodeGraphs", found)
    with pytest.raises(ValueError, match=r"cuda_graphs=\(False, True\): the decode step waits on the host at "
                                         r"dbrx/modeling_dbrx.py:433; use cuda_graphs=\(False, False\) or None"):
        make_engine(model_dir(), cuda_graphs=DECODE_GRAPHS)
    def samples(engine):
        return {key: (row["token_ids"], row["logprobs"]) for key, row in run(engine, PROMPTS[2:], PARAMS[2:]).items()}
    want = samples(make_engine(model_dir()))
    monkeypatch.setattr(model_runner, "resolve", lambda config: DECODE_GRAPHS)  # as on CUDA by default
    engine = make_engine(model_dir())
    assert engine.runner.graphs is None and not engine.runner.decode_graphs
    assert samples(engine) == want


def test_capture_runs_with_the_collector_paused_after_collecting():
    """Garbage is collected (finalizers run) before capture starts, and none while it runs: a finalizer
    that syncs the device mid-capture invalidates the graph. The collector's state is restored, also after
    an error."""
    finalized = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            finalized.append(gc.isenabled())

    Cycle()
    with graphs.collector_paused():
        assert finalized == [True] and not gc.isenabled()
        Cycle()
        garbage = [[] for _ in range(100_000)]  # far past the collector's thresholds
        assert finalized == [True] and garbage
    assert gc.isenabled()
    with pytest.raises(KeyError), graphs.collector_paused():
        raise KeyError
    assert gc.isenabled()
    gc.disable()
    try:
        with graphs.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_wait_on_the_first_launch_only_is_not_a_host_waiting_step():
    """A launch that waits once (Triton's autotuner timing a kernel's configurations, lazy set-up) can
    still be captured; one that waits every time raises HostSync."""
    calls, x = [], torch.ones(1, device="cuda")
    def once():
        calls.append(x.item() if not calls else 0)
    graphs.raise_on_host_sync(once)
    assert len(calls) == 2
    with pytest.raises(graphs.HostSync, match="waits on the host"):
        graphs.raise_on_host_sync(x.item)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_moe_experts_wait_on_the_host(tmp_path):
    """transformers' MoE experts (torch._grouped_mm) stay on the device in bfloat16 only (seen on an H100,
    torch 2.11): in float32 decode graphs are refused when asked for and off by default."""
    path = build_zoo_model("mixtral", tmp_path)
    with pytest.raises(ValueError, match=r"waits on the host at integrations/moe.py:\d+.*bfloat16 only"):
        make_engine(path, device="cuda", cuda_graphs=DECODE_GRAPHS, max_num_seqs=8)
    assert make_engine(path, device="cuda", max_num_seqs=8).runner.graphs is None
    assert make_engine(path, device="cuda", dtype="bfloat16", max_num_seqs=8).runner.graphs.num_captured > 0


def replay_check(runner, inputs) -> tuple[tuple[int, int], int, bool]:
    """Replay the graph of an eligible step after its eager forward: (its key, its real batch, whether
    the replay's logits equal the eager ones, it wrote no slot but the step's own, and the static
    buffers are padded as promised)."""
    eager = runner.forward(inputs, use_graphs=False)
    (before,) = [t.clone() for t in runner.kv_cache.tensors]
    replayed = runner.forward(inputs)
    g, n = runner.graphs, inputs.meta.seq_lens.shape[0]
    batch = min(b for b in g.batch_sizes if b >= n)
    changed = (runner.kv_cache.tensors[0] != before).permute(2, 3, 0, 1, 4, 5).flatten(2).any(2).flatten()  # per slot
    written = set(changed.nonzero().flatten().tolist())
    padded = (bool((g.slots[n:batch] == -1).all()) and not g.seq_lens[n:batch].any()
              and bool((g.cu_seqlens_q[n + 1:batch + 1] == n).all()) and not g.block_table[n:batch].any())
    same = torch.allclose(replayed, eager, rtol=1e-4, atol=1e-4)
    ok = same and padded and written <= set(inputs.meta.slot_mapping.tolist())
    return (batch, kv_bucket(inputs.meta.max_seqlen_k)), n, ok


def checking_replays(engine) -> list[tuple[tuple[int, int], int, bool]]:
    """Make every decode step of `engine` run the replay check and sample from the replay's logits;
    returns the list the checks are recorded in."""
    runner, checks = engine.runner, []

    def checked_launch(seqs, num_tokens, prev=None):
        inputs = runner.prepare(seqs, num_tokens, prev)
        if runner.graphs.eligible(inputs):
            checks.append(replay_check(runner, inputs))
        logits = runner.forward(inputs)
        return runner.sample(logits, inputs) if inputs.num_rows else Sampled.empty(runner.device)

    engine.runner.launch = checked_launch
    return checks


@pytest.fixture(scope="module")
def long_model(model_dir):
    return model_dir("qwen3", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def eager_rows(long_model):
    engine = make_engine(long_model, **ENGINE)
    assert engine.runner.graphs is None, "None means no decode graphs on the CPU"
    return run(engine, PROMPTS, PARAMS)


def test_replays_equal_eager_and_outputs_equal_graphs_off(long_model, eager_rows):
    engine = make_engine(long_model, cuda_graphs=DECODE_GRAPHS, **ENGINE)
    assert sorted(engine.runner.graphs.graphs) == [(b, kv) for b in (1, 2, 4, 8, 16, 24) for kv in (1024, 2048)]
    checks = checking_replays(engine)
    rows = run(engine, PROMPTS, PARAMS)
    assert checks and all(ok for _, _, ok in checks), [c for c in checks if not c[2]]
    assert {kv for (_, kv), _, _ in checks} == {1024, 2048}, "the workload crosses a KV bucket"
    batches = {}
    for key, n, _ in checks:
        batches.setdefault(key, set()).add(n)
    assert any(len(ns) > 1 for ns in batches.values()), "some key replayed steps of different batch sizes"
    assert rows.keys() == eager_rows.keys()
    for key, row in rows.items():
        assert row["token_ids"] == eager_rows[key]["token_ids"], key
        assert row["logprobs"] == pytest.approx(eager_rows[key]["logprobs"], abs=1e-4), key


def test_planted_key_without_the_kv_bucket_fails_the_replay_check(long_model, monkeypatch):
    """transformers #45323: with the KV bucket left out of the key, each batch bucket keeps the graph
    captured last (the smallest KV bucket), which gathers too few blocks for longer sequences."""
    monkeypatch.setattr(graphs, "graph_key", lambda batch, kv: (batch,))
    engine = make_engine(long_model, cuda_graphs=DECODE_GRAPHS, **ENGINE)
    assert sorted(engine.runner.graphs.graphs) == [(b,) for b in (1, 2, 4, 8, 16, 24)]
    checks = checking_replays(engine)
    run(engine, PROMPTS, PARAMS)
    assert {kv for (_, kv), _, ok in checks if not ok} == {2048}
    assert all(ok for (_, kv), _, ok in checks if kv == 1024)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on the CPU runs in its interpreter: TRITON_INTERPRET=1 (set where there is no GPU)")
def test_keys_with_equal_backend_scalars_share_a_graph(long_model, monkeypatch):
    """Triton on a simulated 8-SM card: from batch 2 up, both KV buckets get the same split count, so
    their keys share one graph (captured at the larger bucket), and its replays stay exact."""
    simulate_sms(monkeypatch, 8)
    engine = make_engine(long_model, attention_backend="triton", cuda_graphs=DECODE_GRAPHS, **ENGINE)
    table = engine.runner.graphs.graphs
    assert len(table) == 12 and len({id(entry) for entry in table.values()}) == 7 == engine.runner.graphs.num_captured
    assert table[(1, 1024)] is not table[(1, 2048)] and table[(2, 1024)] is table[(2, 2048)]
    checks = checking_replays(engine)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=5, seed=3, ignore_eos=True)
    run(engine, random_prompts(2, 512, (5, 30), seed=7), params)
    assert checks and all(ok for *_, ok in checks), [c for c in checks if not c[2]]
    assert any(batch > 1 for (batch, _), _, _ in checks), "a shared graph replayed"

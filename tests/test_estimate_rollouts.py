"""scripts/estimate_rollouts.py: the steps it records are the scheduler's (each prompt prefilled once, one
decode per sample per step, their contexts), its cost is the stated model of them, a cache too small for
the rollouts makes it offload and recompute, and bad options are refused before any work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import estimate_rollouts as est  # noqa: E402

SCALE = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return est.build_tiny(tmp_path_factory.mktemp("tiny"))


def test_recorded_steps_and_their_cost_without_pressure(tiny):
    w = est.WORKLOADS["rollouts_1024"]
    prompt, new, samples = w.prompt_len // SCALE, w.new_tokens // SCALE, w.prompts * w.n
    log, stats = est.simulate(tiny, "rollouts_1024", cache_tokens=10**6, pool_tokens=10**5, scale=SCALE)
    assert (stats["offloads"], stats["recomputes"]) == (0, 0)
    assert sum(p for _, _, p in log) == w.prompts * prompt, "each prompt is prefilled once for its n samples"
    assert [d for d, _, _ in log if d] == [samples] * (new - 1), "every sample decodes once per step"
    contexts = samples * sum(prompt + k for k in range(1, new))
    assert sum(c for _, c, _ in log) == contexts
    args = est.parse_args(["--scale", str(SCALE)])
    weights, kv = est.shape("qwen3-1.7b")
    bandwidth, prefill_s = args.bandwidth_gbs * 1e9, args.prefill_us * 1e-6 * weights / est.QWEN_WEIGHT_BYTES
    want = (SCALE * len(log) * weights + SCALE**2 * contexts * kv) / bandwidth + SCALE * w.prompts * prompt * prefill_s
    assert est.cost(log, weights, kv, args) == pytest.approx(want)


def test_a_cache_too_small_offloads_recomputes_and_slows_the_rate(tiny):
    args = est.parse_args(["--scale", str(SCALE)])
    short = est.estimate(tiny, "qwen3-1.7b", "rollouts_1024", args)
    long = est.estimate(tiny, "qwen3-1.7b", "rollouts_8192", args)
    assert long["cache_tokens"] < 256 * (256 + 8192), "the H100's cache cannot hold rollouts_8192"
    assert (short["offloads"], short["recomputes"]) == (0, 0)
    assert long["offloads"] > 0 and long["recomputes"] > 0
    assert long["tokens_per_s"] < short["tokens_per_s"] / 2


@pytest.mark.parametrize("argv, message", [
    (["--scale", "3"], "--scale=3 must divide"),
    (["--bandwidth-gbs", "0"], "--bandwidth-gbs=0.0 must be a finite number > 0"),
    (["--card-gib", "nan"], "--card-gib=nan must be a finite number > 0"),
    (["--prefill-us", "inf"], "--prefill-us=inf must be a finite number > 0"),
    (["--offload-gib", "-1"], "--offload-gib=-1.0 must be a finite number >= 0"),
    (["--peak-gib", "nan"], "--peak-gib=nan must be a finite number >= 0"),
    (["--memory-utilization", "1.5"], "--memory-utilization=1.5 must be at most 1"),
    (["--workloads", "decode"], "invalid choice: 'decode'"),
    (["--card-gib", "4"], "--card-gib=4.0 x --memory-utilization=0.9 - --peak-gib=3.0 leaves no KV cache")])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        est.parse_args(argv)
    assert message in capsys.readouterr().err

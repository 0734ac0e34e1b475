"""scripts/bench_gpu.py --smoke end to end on the CPU: a table per workload with a row per system and the
status this branch and device should give, every run that finished generated exactly its workload's
tokens, a run cut at --window-s counts what it made, and a bad option is refused before any work."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
TABLE = re.compile(r"^(\S+) / (\S+): (.*)$")
ROW = re.compile(r"^(\S+)\s.*?\s{2}((?:ok|unavailable|failed|skipped)\b.*)$")
SIZES = re.compile(r"(\d+) prompts x \d+ tokens, n=(\d+), (\d+) new tokens")


def bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the script in a child process with its model cache under `tmp_path`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "BENCH_GPU_CACHE": str(tmp_path / "models")}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def tables(stdout: str) -> dict[str, tuple[str, dict[str, str]]]:
    """{workload: (its description line, {system: status})} from the printed tables (the summary of
    targets after them excluded)."""
    out, current = {}, None
    for line in stdout.split("\ntargets:\n")[0].splitlines():
        if match := TABLE.match(line):
            current = out[match[2]] = (match[3], {})
        elif current and (match := ROW.match(line)):
            current[1][match[1]] = match[2]
        elif not line.strip():
            current = None
    return out


def test_smoke_prints_every_table_and_generates_the_workloads_tokens(tmp_path):
    results = tmp_path / "bench.json"
    proc = bench(tmp_path, "--smoke", "--no-progress", "--json", str(results),
                 "--workloads", "decode", "multi_return_seq", "few_blocks", "rollouts_1024", "--profile-decode", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    printed = tables(proc.stdout)
    assert list(printed) == ["decode", "multi_return_seq", "few_blocks", "rollouts_1024"]
    engine_on = "ok" if {"cuda_graphs", "async_batching"} & set(EngineConfig.__struct_fields__) else "unavailable"
    for workload, (_, rows) in printed.items():
        hf = {} if workload == "decode" else {"hf-default": "ok", "hf-graphs-async": "unavailable"}  # CPU
        expected = {"engine-on": engine_on, "engine-off": "ok", **hf}
        assert {system: status.split(":")[0].split(" ")[0] for system, status in rows.items()} == expected, rows

    runs = json.loads(results.read_text())["runs"]
    assert len(runs) == sum(len(rows) for _, rows in printed.values())
    for run in runs:
        if run["status"] != "ok":
            continue
        if run["workload"] == "decode":
            assert run["seqs"] == 16 and run["context"] > 32 and run["ms_per_step"] > 0
            assert 0 < run["roofline_share"] == run["roofline_ms"] / run["ms_per_step"]
            profile = run["profile"]  # aten operators on the CPU, the busiest first
            assert len(profile["kernels"]) == 3 and profile["kernels"][0][1] >= profile["kernels"][-1][1] > 0
            assert sum(ms for _, ms, _ in profile["kernels"]) <= profile["busy_ms_per_step"]
            assert f"{run['system']}: the device is busy" in proc.stdout
            assert f"{run['system']} start-up {run['startup_s']:.1f} s: load " in proc.stdout
        else:
            prompts, n, new = map(int, SIZES.search(printed[run["workload"]][0]).groups())
            assert run["tokens"] == prompts * n * new, run
            assert run["tokens_per_s"] > 0 and run["startup_s"] > 0
            if run["system"].startswith("engine"):
                assert sum(run["startup_phases_s"].values()) < run["startup_s"]
                peer = next(r for r in runs if r["workload"] == run["workload"] and r["system"] == "hf-default")
                assert run["ratio_vs"] == {"hf-default": run["tokens_per_s"] / peer["tokens_per_s"]}  # as printed


@pytest.mark.parametrize("option", [("--workloads", "rollouts_999"), ("--profile-decode", "-1")])
def test_a_bad_option_is_refused_before_any_work(tmp_path, option):
    results = tmp_path / "bench.json"
    proc = bench(tmp_path, "--smoke", *option, "--json", str(results))
    assert proc.returncode == 2 and option[1] in proc.stderr
    assert not results.exists() and not (tmp_path / "models").exists()


def test_a_window_cuts_every_system_and_counts_the_unfinished_tokens(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_gpu
    import bench_gpu_runs as runs

    long = runs.Workload("long", prompts=2, prompt_len=16, n=2, new_tokens=3000)  # minutes on this CPU
    args = argparse.Namespace(device="cpu", dtype="float32", torch_dtype=torch.float32, progress=False,
                              engine_extra={"kv_cache_memory_gib": 0.05}, offload_gib=0.01, budget_s=None,
                              hf_extra={"page_size": 16, "num_blocks": 4 * 3016 // 16 + 8, "max_batch_tokens": 256},
                              window_s=1.0, hf_timeout_s=240.0, workload_defs={"long": long}, t0=0.0)
    path = runs.prepare_model(tmp_path, "tiny", torch.float32, "cpu")
    rows = [bench_gpu.run_one("tiny", path, "long", s, args) for s in ("engine-on", "engine-off", "hf-default")]
    for row in rows:
        assert row["status"] == "ok" and row["cut"], row
        assert 0 < row["tokens"] < long.tokens and row["samples_finished"] == 0, row
        assert row["seconds"] >= args.window_s and row["tokens_per_s"] == row["tokens"] / row["seconds"]
        assert f"cut at the 1 s window: {row['tokens']} of {long.tokens} tokens, 0 of 4 samples" in row["note"]
    target = bench_gpu.print_workload("tiny", "long", rows, args)
    assert "(hf-default)" in target and target.endswith(", over a 1 s window)"), target


def test_a_profiler_failure_keeps_the_probe_and_says_why(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_profile

    def step():
        raise RuntimeError("CUPTI unavailable")

    profile = bench_profile.profile_steps(step, "cpu", top=3)
    assert profile == {"error": "RuntimeError: CUPTI unavailable"}
    bench_profile.print_profile([{"system": "engine-on", "ms_per_step": 1.0, "profile": profile}])
    assert "engine-on: no kernel profile (RuntimeError: CUPTI unavailable)" in capsys.readouterr().out

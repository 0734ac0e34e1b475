"""scripts/gpu_check.sh's control flow, with a stand-in `python3` that only logs what it is asked to run: the
steps run in their order, a step past GPU_CHECK_TOTAL_S is stopped or never started without failing the
check, and a failing test or benchmark fails it. A broken check would waste a GPU session's few minutes."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the stand-in: each step logs its script's name; FAIL names a step that exits 1, SLOW one that sleeps 30 s,
# DEAF one that sleeps 30 s deaf to SIGINT (as a process waiting in C code or on a worker thread)
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in *"pip install"*|*"import torch, triton"*) exit 0;; esac
step=$(printf '%s\\n' "$@" | grep -m1 -oE '[a-z_]+\\.py' || echo "$1")
echo "$step" >> "$STEPS"
[[ "$*" == *"$SLOW"* ]] && exec sleep 30
[[ "$*" == *"$DEAF"* ]] && { trap '' INT; sleep 30; exit 0; }
[[ "$*" == *"$FAIL"* ]] && exit 1
exit 0
"""


def run_check(tmp_path: Path, total_s: int = 60, fail: str = "-none-", slow: str = "-none-", deaf: str = "-none-",
              **env: str) -> tuple[int, list[str], str]:
    """Run gpu_check.sh with the stand-in; returns its exit code, the steps run in order, and its output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    steps = tmp_path / "steps.txt"
    steps.unlink(missing_ok=True)
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                   "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                   "STEPS": str(steps), "FAIL": fail, "SLOW": slow, "DEAF": deaf, "GPU_CHECK_TOTAL_S": str(total_s),
                   **env}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, steps.read_text().split() if steps.exists() else [], done.stdout


def test_steps_run_in_order_and_pass(tmp_path):
    rc, steps, out = run_check(tmp_path)
    assert rc == 0, out
    assert list(dict.fromkeys(steps)) == [
        "test_triton_kernels.py", "test_fla.py", "bench_delta_rule.py", "bench_norm.py", "bench_pin.py", "bench_gpu.py",
        "bench_attention.py", "test_model_coverage.py"]
    assert steps.count("bench_attention.py") == 4
    assert {"tests.log", "bench_gpu.log", "fla.log", "coverage.log"} <= set(os.listdir(tmp_path / "out"))
    assert len(os.listdir(tmp_path / "out")) <= 8  # the most files a device call brings back


def test_autotuning_results_are_seeded_and_brought_back(tmp_path):
    """The cache starts with scripts/gpu_autotune/'s results; every result in it at the end is in autotune.tgz:
    those committed and the session's new one."""
    committed = [f"./{p.relative_to(ROOT / 'scripts/gpu_autotune')}"
                 for p in (ROOT / "scripts/gpu_autotune").glob("*/*.autotune.json")]
    tuned = tmp_path / "triton" / "0a1b" / "chunk_fwd_kernel.autotune.json"
    tuned.parent.mkdir(parents=True)
    tuned.write_text("{}")
    (tuned.parent / "chunk_fwd_kernel.cubin").write_text("binary")
    rc, _, out = run_check(tmp_path)
    assert rc == 0, out
    assert (tmp_path / "triton" / "README.md").read_text() == (ROOT / "scripts/gpu_autotune/README.md").read_text()
    with tarfile.open(tmp_path / "out" / "autotune.tgz") as archive:
        assert sorted(archive.getnames()) == sorted([*committed, "./0a1b/chunk_fwd_kernel.autotune.json"])


@pytest.mark.parametrize("failing", [
    "test_triton_kernels.py", "bench_norm.py", "bench_pin.py", "bench_gpu.py", "test_fla.py"])
def test_a_failing_step_fails_the_check(tmp_path, failing):
    rc, steps, out = run_check(tmp_path, fail=failing)
    assert rc == 1, out
    assert "test_model_coverage.py" in steps  # the steps after it still ran


def test_a_step_past_the_limit_is_stopped_and_the_rest_not_started(tmp_path):
    rc, steps, out = run_check(tmp_path, total_s=3, slow="bench_gpu.py")
    assert rc == 0, out
    assert steps[-1] == "bench_gpu.py" and "bench_attention.py" not in steps
    assert "bench_gpu.py: stopped at GPU_CHECK_TOTAL_S=3 s" in out
    assert "scripts/bench_attention.py: not started" in out and "bench_gpu exit 124" in out


def test_the_engine_tests_are_stopped_at_the_limit_too(tmp_path):
    """A hung engine test must not hold the call past its limit: pytest is interrupted (its summary says what
    failed and where it hung), nothing else starts, and the check fails."""
    start = time.monotonic()
    rc, steps, out = run_check(tmp_path, total_s=3, slow="test_triton_kernels.py")
    assert time.monotonic() - start < 20, out
    assert rc == 1 and steps == ["test_triton_kernels.py"], out
    assert "tests/test_triton_kernels.py: stopped at GPU_CHECK_TOTAL_S=3 s" in out
    assert "tests/test_fla.py: not started" in out and "pytest exit 124" in out


def test_a_step_deaf_to_the_interrupt_is_killed(tmp_path):
    """A step that goes on after SIGINT is killed 15 s later, and counts as stopped by the limit."""
    start = time.monotonic()
    rc, steps, out = run_check(tmp_path, total_s=3, deaf="test_fla.py")
    assert time.monotonic() - start < 25, out
    assert rc == 0 and steps[-1] == "test_fla.py", out
    assert "tests/test_fla.py: stopped at GPU_CHECK_TOTAL_S=3 s" in out and "test_fla exit 124" in out


def test_skip_bench_gpu_leaves_it_out(tmp_path):
    rc, steps, out = run_check(tmp_path, SKIP_BENCH_GPU="1")
    assert rc == 0, out
    assert "bench_gpu.py" not in steps and "test_model_coverage.py" in steps

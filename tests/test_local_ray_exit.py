"""What the embedded Ray leaves behind when its process exits without `rollout.shutdown()`, or is sent SIGTERM
while Ray starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

START_AND_EXIT = textwrap.dedent("""
    import sys
    from rollout import local_ray
    from rollout.config import load_service_config
    local_ray.start_local_ray(load_service_config(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3))
    print(local_ray._private_dirs[0], flush=True)
    raise SystemExit(3)  # a trainer script that ends, or fails, before rollout.shutdown()
""")


TERM_WHILE_CONNECTING = textwrap.dedent("""
    import os, signal, sys
    import ray._private.worker as worker
    connect = worker.connect
    def connect_then_term(*args, **kwargs):  # the driver's core worker is up, ray.init not yet returned
        connect(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
    worker.connect = connect_then_term
    from rollout import local_ray
    from rollout.config import load_service_config
    local_ray.start_local_ray(load_service_config(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3))
    print("SIGTERM did not end the process", flush=True)
""")


CALL_AFTER_EXIT_HOOK = textwrap.dedent("""
    import atexit, sys
    import ray
    def late_call():  # runs after rollout's exit hook, as a thread still reading a stream does
        try:
            ray.put(1)
            print("a Ray was started at exit", flush=True)
        except Exception as err:
            print("refused:", type(err).__name__, flush=True)
    atexit.register(late_call)
    import rollout
    from rollout import local_ray
    from rollout.config import load_service_config
    if sys.argv[2] == "init":
        rollout.init(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3)
    else:
        local_ray.start_local_ray(load_service_config(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3))
""")


EXIT_WHILE_A_THREAD_READS = textwrap.dedent("""
    import sys, threading
    import rollout
    rollout.init(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3, flush_rows=1)
    reading = threading.Semaphore(0)
    def read():  # a trainer's prefetching thread: call after call
        while True:
            for batch in rollout.sample([[5, 6, 7]] * 4, n=4, max_new_tokens=5):
                reading.release()
    for _ in range(4):
        threading.Thread(target=read, daemon=True).start()
    for _ in range(40):
        reading.acquire(timeout=60)
    print("the script ends without rollout.shutdown()", flush=True)
""")


@pytest.fixture
def short_tmp():
    """A fresh directory with a short path (Ray's socket paths under it must stay within 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rx-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_script(script: str, ray_tmpdir: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`script` run by a fresh Python with `args`, its Ray sessions under `ray_tmpdir`."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "RAY_TMPDIR": str(ray_tmpdir)})


def test_a_process_that_exits_without_shutdown_leaves_no_session_directory(model_dir, short_tmp):
    """Ray's session (logs, sockets) lives under a private directory that `stop_local_ray` removes; a process
    that never called it removes it at exit too, instead of leaving one in /tmp per run."""
    done = run_script(START_AND_EXIT, short_tmp, model_dir("qwen3"))
    assert done.returncode == 3, done.stderr[-2000:]
    private = Path(done.stdout.split()[-1])
    assert private.parent == short_tmp and private.name.startswith("rollout-ray-")
    assert not private.exists(), sorted(p.name for p in private.rglob("*"))[:10]


def test_a_sigterm_while_ray_connects_exits_as_sigterm_does_and_leaves_nothing(model_dir, short_tmp):
    """Ray's C++ failure-signal handler, installed in this process as its core worker starts, took SIGTERM from
    Python's: a SIGTERM then printed Ray's stack dump and aborted (status 134), leaving Ray's session behind."""
    done = run_script(TERM_WHILE_CONNECTING, short_tmp, model_dir("qwen3"))
    assert done.returncode == 15, done.stderr[-2000:]
    assert "SIGTERM received" not in done.stderr and "did not end" not in done.stdout
    assert list(short_tmp.iterdir()) == []


@pytest.mark.parametrize("started_by", ["init", "start_local_ray"])
def test_a_ray_call_after_the_exit_hook_starts_no_other_ray(model_dir, short_tmp, started_by):
    """A thread reading a stream when a script ends without `rollout.shutdown()` called Ray after the exit hook
    had stopped the embedded one: Ray's automatic `ray.init` then started a Ray of its own, with a dashboard,
    whose world-writable session directory stayed."""
    done = run_script(CALL_AFTER_EXIT_HOOK, short_tmp, model_dir("qwen3"), started_by)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout, done.stdout
    assert list(short_tmp.iterdir()) == []


def test_a_script_that_ends_while_threads_read_streams_exits_cleanly(model_dir, short_tmp):
    """Ray stopped under threads calling the service: one calling Ray after it had stopped made Ray's C++ end the
    process (status 1) before the exit hook removed the session directory. The service is now shut down first,
    as `rollout.shutdown()` does, so the threads' calls end before Ray stops."""
    done = run_script(EXIT_WHILE_A_THREAD_READS, short_tmp, model_dir("qwen3"), timeout_s=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ends without" in done.stdout
    assert list(short_tmp.iterdir()) == []

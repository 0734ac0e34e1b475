"""The embedded service when the process's Ray changes under it: Ray started from a thread that ends, a stream
and a client kept past `shutdown` and used in the next service, a `ray.shutdown()` of the caller's before
`rollout.shutdown()`, and Ctrl-C while the embedded Ray starts. Each runs in a process of its own, since
the failures they guard against end the process (Ray's GCS client, or a C++ check of Ray's)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import gc, os, signal, subprocess, sys, threading, time
    import ray, rollout
    from rollout.service_lost import ServiceUnavailable
    from trainer_client import RolloutClient
    OPTIONS = dict(model=sys.argv[1], num_workers=1, object_store_memory_gib=0.3, num_blocks=64)

    def children():
        out = subprocess.run(["ps", "-eo", "pid,ppid,comm"], capture_output=True, text=True).stdout
        return [line.split()[2] for line in out.splitlines()[1:]
                if line.split()[1] == str(os.getpid()) and line.split()[2] != "ps"]

    def refused(call):
        try:
            call()
        except ServiceUnavailable as err:
            return "Ray it reached the rollout service through" in str(err)
        return False
""")

THREAD = """
thread = threading.Thread(target=rollout.init, kwargs=OPTIONS)
thread.start()
thread.join()
time.sleep(2)  # Ray's processes would die with the thread that started them
print("rows", rollout.sample([[5, 6, 7]], n=2, max_new_tokens=3).to_table().num_rows)
print("blocks", RolloutClient.connect(timeout_s=30).stats()[0]["blocks_total"])  # needs the GCS alive
rollout.shutdown()
time.sleep(2)
print("left", children())
"""

STALE = """
rollout.init(**OPTIONS)
old_stream = rollout.sample([[5, 6, 7]], n=2, max_new_tokens=50)
old_client = RolloutClient.connect(timeout_s=30)
rollout.shutdown()
rollout.init(**OPTIONS)
print("stream refused", refused(old_stream.to_table))
print("stats refused", refused(old_client.stats))
print("sample refused", refused(lambda: old_client.sample([[5]], n=1)))
del old_stream
gc.collect()
print("rows", rollout.sample([[5, 6, 7]], n=2, max_new_tokens=3).to_table().num_rows)
rollout.shutdown()
"""

RAY_SHUTDOWN_FIRST = """
import tempfile
rollout.init(**OPTIONS)
ray.shutdown()
print("sample refused", refused(lambda: rollout.sample([[5]], n=1)))
rollout.shutdown()
print("ray initialised", ray.is_initialized())
rollout.init(**OPTIONS)
ray.shutdown()
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rx-"))  # a Ray of the caller's
rollout.shutdown()  # leaves that Ray, and the token it started with, alone
print("own ray", ray.get(ray.remote(lambda: 7).remote()))
ray.shutdown()
"""

SIGTERM_HANDLERS = """
signal.signal(signal.SIGTERM, lambda signum, frame: print("handled", flush=True))
rollout.init(**OPTIONS)
rollout.shutdown()  # Ray's shutdown resets SIGTERM's handler below Python's
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
rollout.init(**OPTIONS)
rollout.shutdown()
print("default again", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""

INTERRUPTED_START = """
sig = getattr(signal, sys.argv[2])
signal.signal(signal.SIGTERM, signal.default_int_handler)  # as the CLI does while the service runs
start = ray.init
def interrupted_init(*args, **kwargs):  # the signal two seconds into ray.init, while it starts Ray's processes
    threading.Timer(2.0, os.kill, (os.getpid(), sig)).start()
    return start(*args, **kwargs)
ray.init = interrupted_init
try:
    rollout.init(**OPTIONS)
except KeyboardInterrupt:
    print("interrupted")
time.sleep(2)
print("ray initialised", ray.is_initialized())
print("left", children())
"""


def run(script: str, model: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PRELUDE + script, model, *args], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.fixture
def model(model_dir) -> str:
    return model_dir("qwen3")


def test_a_service_started_from_a_thread_outlives_the_thread(model):
    """Ray's processes die with the thread that started them (PR_SET_PDEATHSIG): a trainer whose first
    `sample` ran in a worker thread lost its GCS when the thread ended, and the process was ended 60 s later."""
    assert run(THREAD, model) == ["rows 2", "blocks 64", "left []"]


def test_a_stream_and_a_client_of_an_earlier_service_are_refused(model):
    """Reading a stream kept past `shutdown` in the next service failed a check of Ray's that ended the process;
    an old client's calls raised Ray's bare "from a different cluster"."""
    assert run(STALE, model) == ["stream refused True", "stats refused True", "sample refused True", "rows 2"]


def test_shutdown_after_the_callers_ray_shutdown_starts_no_ray(model):
    """`rollout.shutdown()` after `ray.shutdown()` called the dead service, so Ray started a default cluster
    (in the world-writable /tmp/ray) and `init` was refused from then on."""
    assert run(RAY_SHUTDOWN_FIRST, model) == ["sample refused True", "ray initialised False", "own ray 7"]


def test_shutdown_leaves_sigterm_handled_as_before_init(model):
    """A Python SIGTERM handler of the caller's still runs after `shutdown` (Ray's resets it in C, where Python
    does not see it), and a default one is default again (the embedded Ray's `sys.exit` handler is undone)."""
    assert run(SIGTERM_HANDLERS, model) == ["handled", "default again True"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_while_the_embedded_ray_starts_leaves_no_process(model, sig):
    """A `ray.init` stopped part way left Ray's processes running, unknown to `ray.shutdown`: the interrupt
    (or the CLI's SIGTERM) is held until Ray has started, then `init` stops it and raises."""
    assert run(INTERRUPTED_START, model, sig) == ["interrupted", "ray initialised False", "left []"]

"""What the embedded Ray leaves behind when its process exits without `rollout.shutdown()`."""

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


@pytest.fixture
def short_tmp():
    """A fresh directory with a short path (Ray's socket paths under it must stay within 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rx-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_process_that_exits_without_shutdown_leaves_no_session_directory(model_dir, short_tmp):
    """Ray's session (logs, sockets) lives under a private directory that `stop_local_ray` removes; a process
    that never called it removes it at exit too, instead of leaving one in /tmp per run."""
    done = subprocess.run([sys.executable, "-c", START_AND_EXIT, model_dir("qwen3")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "RAY_TMPDIR": str(short_tmp)})
    assert done.returncode == 3, done.stderr[-2000:]
    private = Path(done.stdout.split()[-1])
    assert private.parent == short_tmp and private.name.startswith("rollout-ray-")
    assert not private.exists(), sorted(p.name for p in private.rglob("*"))[:10]

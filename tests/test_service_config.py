"""Bad service configs fail at `rollout.init` with the field's path, before any Ray process starts."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import ray
import torch

import rollout
from rollout.config import LOCAL_CONFIG, EngineConfig, load_service_config
from rollout.local_ray import start_local_ray, stop_local_ray


@pytest.fixture
def model(model_dir):
    return model_dir("qwen3")


@pytest.mark.parametrize("overrides, message", [
    (dict(num_workers=0), r"ServiceConfig.num_workers=0 must be >= 1"),
    (dict(num_workers="two"), r"Expected `int \| null`, got `str` - at `\$.num_workers`"),
    (dict(bogus=1), r"unknown field `bogus`"),
    (dict(dtype="int4"), r"EngineConfig.dtype='int4' must be one of .* - at `\$.engine`"),
    (dict(engine={"block_size": "big"}), r"Expected `int`, got `str` - at `\$.engine.block_size`"),
    (dict(flush_delay_s=-1.0), r"ServiceConfig.flush_delay_s=-1.0 must be >= 0"),
    (dict(device="cuda:1"), r"engine.device='cuda:1' must be one of \('cpu', 'cuda'\)"),
    (dict(worker_stall_timeout_s=0.0), r"ServiceConfig.worker_stall_timeout_s=0.0 must be > 0"),
    (dict(namespace=""), r"ServiceConfig.namespace must not be empty"),
])
def test_bad_overrides(model, overrides, message):
    with pytest.raises(ValueError, match=message):
        rollout.init(model=model, **overrides)
    assert not ray.is_initialized()


def test_bad_files(tmp_path, model):
    with pytest.raises(ValueError, match="does not exist"):
        rollout.init(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="config=42 must be a path to a TOML file or a ServiceConfig, not int"):
        rollout.init(42)
    bad = tmp_path / "bad.toml"
    bad.write_text('num_workers = 2\n[engine]\nmodel = 3\n')
    with pytest.raises(ValueError, match=r"Expected `str`, got `int` - at `\$.engine.model`"):
        rollout.init(bad)
    with pytest.raises(ValueError, match="is not a model directory"):
        rollout.init(model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="STRICT_SPREAD' puts each of num_workers=2 workers on a node of its own"):
        rollout.init(model=model, num_workers=2, placement_strategy="STRICT_SPREAD")  # waited out the placement
    assert not ray.is_initialized()


def test_shipped_configs_load(tmp_path):
    local = load_service_config()
    assert local.num_workers == 2 and local.engine.device == "cpu" and not local.engine.model.startswith("~")
    cluster = load_service_config(Path(__file__).parents[1] / "configs" / "cluster.toml")
    assert cluster.num_workers is None and cluster.engine.device == "cuda"
    assert load_service_config(cluster, model="/m", num_workers=3).engine.model == "/m"
    engine = load_service_config(engine=EngineConfig(model="/e", num_blocks=7)).engine
    assert (engine.model, engine.num_blocks, engine.dtype) == ("/e", 7, "auto")


def test_a_model_path_may_be_a_path_object():
    """`rollout.init(model=demo_model())`: a `Path`, as `init`'s config and `update_weights` take, held as a str."""
    assert EngineConfig(model=Path("/e")).model == "/e"
    for given in (dict(model=Path("~/m")), dict(engine={"model": Path("~/m")}),
                  dict(engine=EngineConfig(model=Path("~/m")))):
        assert load_service_config(**given).engine.model == f"{Path.home()}/m"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_cuda_workers_without_gpus_fail_at_once(model):
    with pytest.raises(ValueError, match="needs 1 GPUs; this machine has 0"):
        rollout.init(model=model, device="cuda", num_workers=1)
    assert not ray.is_initialized()


def test_workers_that_cannot_be_placed_fail_after_the_placement_timeout(model):
    """Two workers of all this machine's CPUs each do not fit: init fails naming the resources,
    instead of waiting for ever, and leaves the caller's Ray running."""
    cpus = float(os.cpu_count())
    start_local_ray(load_service_config(model=model, num_workers=1))
    try:
        with pytest.raises(RuntimeError, match=rf"could not place 2 workers of \{{'CPU': {cpus}\}} within 2.0 s"):
            rollout.init(model=model, num_workers=2, cpus_per_worker=cpus, placement_timeout_s=2.0)
        assert ray.is_initialized()
    finally:
        stop_local_ray()


def _setuptools_builds_wheels() -> bool:
    """Whether the installed setuptools builds a wheel itself (bdist_wheel is built in from 70.1), so the test
    needs no build isolation (a download); pyproject's build-system asks for 68 or newer."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in version.split(".")[:2]) >= (70, 1)


@pytest.mark.skipif(not _setuptools_builds_wheels(), reason="needs setuptools >= 70.1 to build the wheel offline")
def test_the_wheel_carries_the_default_service_config(tmp_path):
    """`pip install .` (not `-e`) has no configs/ directory: the default config that `rollout demo`, `rollout
    sample` and `rollout.sample` without `init` read must travel inside the package, and load from there."""
    root = Path(__file__).parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path,
                    root], check=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("rollout-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("rollout/local.toml") == LOCAL_CONFIG.read_bytes()
        archive.extractall(tmp_path / "site")
    code = "import rollout.config as c; print(c.__file__); print(c.load_service_config().engine.model)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}).stdout
    assert out.split() == [str(tmp_path / "site" / "rollout" / "config.py"), load_service_config().engine.model]
    assert (root / "configs" / "local.toml").resolve() == LOCAL_CONFIG

"""The Triton kernels compile for real GPUs without one: every launch TritonBackend makes, the Gated
DeltaNet decode's and the fused RMS norm's, for Ampere (sm_80) and Hopper (sm_90), in bfloat16 and float16,
through Triton's compiler and the ptxas it bundles (scripts/kernel_resources.py, run in a process without
TRITON_INTERPRET). This covers what the interpreter cannot: code generation, bfloat16, the compiled launch
options."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "kernel_resources.py"
HAS_NVIDIA_BACKEND = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


def script_constants():
    """MODELS, PATHS, DELTA_MODELS and NORM_MODELS of the script, the shapes it compiles."""
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODELS, module.PATHS, module.DELTA_MODELS, module.NORM_MODELS


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="this Triton build has no NVIDIA backend")
@pytest.mark.timeout(300)
def test_kernels_compile_for_ampere_and_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(SCRIPT), "--arch", "80", "90", "--dtype", "bfloat16",
                             "float16"], capture_output=True, text=True, env=env, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    compiled: dict[tuple, set[str]] = {}
    for arch, dtype, model, path, kernel, *_ in rows:
        compiled.setdefault((arch, dtype, model, path), set()).add(kernel)
    models, paths, delta_models, norm_models = script_constants()
    for arch, dtype in itertools.product(("sm_80", "sm_90"), ("bfloat16", "float16")):
        for model, path in itertools.product(models, paths):
            split = {"merge_splits_kernel"} if path == "split" else set()
            expected = {"store_kv_kernel", "paged_attention_kernel"} | split
            assert compiled[(arch, dtype, model, path)] == expected, (arch, dtype, model, path)
        for model in delta_models:
            delta = {"gated_delta_decode_kernel", "short_conv_decode_kernel"}
            assert compiled[(arch, dtype, model, "decode")] == delta, (arch, dtype, model)
        for model in norm_models:
            assert compiled[(arch, dtype, model, "decode")] == {"rms_norm_kernel"}, (arch, dtype, model)
    assert all(int(regs) > 0 for *_, regs, _stack, _smem in rows)

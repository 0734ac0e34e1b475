#!/usr/bin/env bash
# Fill .whl/ (git-ignored; name it in the device call's carry) with the wheels the GPU image lacks:
#   - msgspec, from ../shared/wheels (the project's configs and messages need it);
#   - flash-linear-attention and fla-core (pure Python with Triton kernels, downloaded here), which
#     transformers runs for Gated DeltaNet layers (Qwen3.5) instead of its PyTorch reference: without them
#     a Qwen3.5-shaped decode step took 97 ms on an H200, 6% of its memory roofline (docs/benchmarks.md).
# gpu_check.sh installs msgspec for everything it runs, and the fla wheels for tests/test_fla.py and
# bench_gpu.py only (fla changes transformers process-wide once imported). SKIP_FLA=1 leaves them out.
set -euo pipefail
mkdir -p .whl
cp ../shared/wheels/msgspec-*.whl .whl/
if [ "${SKIP_FLA:-0}" != 1 ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
        flash-linear-attention==0.6.0 fla-core==0.6.0 ||
        echo "gpu_wheels: could not download the fla wheels; Gated DeltaNet layers will run transformers' reference"
fi
ls .whl

#!/usr/bin/env bash
# The README's test command: installs what the tests need (CPU torch pinned), lints, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
python3 -m ruff check .
# Two test processes (pytest-xdist; CI's machine has 2 cores), one torch thread each (tests/conftest.py).
# Arguments go to pytest, `-n 0` among them runs every test in this process.
python3 -m pytest -q -n 2 "$@"

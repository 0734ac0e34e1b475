#!/usr/bin/env bash
# The README's test command: installs what the tests need (CPU torch pinned), lints, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
python3 -m ruff check .
python3 -m pytest -q "$@"

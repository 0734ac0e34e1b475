#!/usr/bin/env bash
# Runs the tests on the oldest versions pyproject.toml admits: every `>=X` bound among the dependencies
# (test extras included) becomes `==X` in a fresh venv, NumPy stays below 2.4, the rest resolve as pip likes.
# Arguments go to pytest.
#   bash scripts/test_lowest.sh                      # the whole suite, about 15 minutes on 2 cores with the install
#   VENV=/tmp/low bash scripts/test_lowest.sh -x tests/test_engine_parity.py
# pip's torch for Linux is a CUDA build (a few GB); the tests run it on the CPU. Not part of CI (time).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-/tmp/rollout-lowest}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
python3 - > "$VENV/lowest.txt" <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    if m := re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?>=([^,;\s]+)", req.strip()):
        print(f"{m[1]}=={m[3]}")
print("numpy<2.4")  # the interpreters of Triton 3.2 and 3.6 fail under NumPy 2.4 (3.8 and 3.9 run)
EOF
echo "test_lowest: pinned $(tr '\n' ' ' < "$VENV/lowest.txt")"
"$VENV/bin/python" -m pip install -q -c "$VENV/lowest.txt" -e '.[test]'
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE "^($(sed -E 's/[=<].*//' "$VENV/lowest.txt" | paste -sd'|')) "
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"

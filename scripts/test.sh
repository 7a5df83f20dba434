#!/usr/bin/env bash
# README command 2: install verispec with its test dependencies and run the test suite (offline, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
HF_HUB_OFFLINE=1 exec .venv/bin/python -m pytest -q "$@"

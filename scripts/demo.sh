#!/usr/bin/env bash
# README command 1: install everything, then generate speculatively with the default Qwen pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models
exec .venv/bin/verispec generate --prompt "${1:-Write a Python function that checks whether a string is a palindrome.}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-128}" --temperature 0 --seed 0

#!/usr/bin/env bash
# README command 1: install everything, then generate speculatively: the default target drafted by the
# distilled tiny draft that ships inside the package (no training needed). DRAFT=... picks another drafter,
# e.g. DRAFT=qwen2.5-coder-0.5b-instruct for the 0.5B draft model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models
exec .venv/bin/verispec generate --prompt "${1:-Write a Python function that checks whether a string is a palindrome.}" \
  --draft "${DRAFT:-distilled}" --max-new-tokens "${MAX_NEW_TOKENS:-128}" --temperature 0 --seed 0

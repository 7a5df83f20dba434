#!/usr/bin/env bash
# README command 1: install everything, then generate speculatively on verispec's native CPU runner: the
# default target drafted by the 0.5B draft model, K chosen every step from measured costs and acceptance
# (--auto-k). DRAFT=... picks another drafter: DRAFT=distilled (the tiny draft shipped inside the package),
# DRAFT=ngram (prompt lookup), DRAFT=none (plain decoding).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models
exec .venv/bin/verispec generate --prompt "${1:-Write a Python function that checks whether a string is a palindrome.}" \
  --draft "${DRAFT:-qwen2.5-coder-0.5b-instruct}" --auto-k --max-new-tokens "${MAX_NEW_TOKENS:-128}" --temperature 0 --seed 0

#!/usr/bin/env bash
# README command 1: install everything, then generate speculatively on verispec's native CPU runner as `verispec
# generate` does by default: the default target drafted by suffix decoding, K chosen every step from measured costs
# and acceptance (--auto-k). DRAFT=... picks another drafter: DRAFT=qwen2.5-coder-0.5b-instruct (the draft model),
# DRAFT=distilled (the tiny draft shipped inside the package), DRAFT=ngram (prompt lookup), DRAFT=none (plain).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --models
exec .venv/bin/verispec generate --prompt "${1:-Write a Python function that checks whether a string is a palindrome.}" \
  --draft "${DRAFT:-suffix}" --auto-k --max-new-tokens "${MAX_NEW_TOKENS:-128}" --temperature 0 --seed 0

#!/usr/bin/env bash
# One GPU session's measurements in one command (the device machine starts bare: no venv, its own torch).
#   bash benchmarks/gpu_session.sh [gpu_bench.py arguments]
# Writes under $OUT (or ./artifacts/gpu_session): env.txt, pytest_gpu.log, bench.log and gpu_bench.json with plots;
# PROFILE_SIZE=8b first runs gpu_profile.py (profile.json, profile_table.txt). The first H200 lease's plan for the
# next: PROFILE_SIZE=8b BENCH_TIMEOUT=330 bash benchmarks/gpu_session.sh --sizes 8b --batches 1,4 (inductor).
# Wheels in .whl/ (e.g. the transformers this project is tested with) are installed to /tmp/site first.
# PYTEST_TIMEOUT / BENCH_TIMEOUT bound each stage in seconds (TEST_TIMEOUT each test, with pytest-timeout where it is
# installed); SKIP_PYTEST=1 skips the tests. A benchmark that fails within its first 90 s (a compile backend that
# breaks on this GPU, say) is run again eagerly with --no-compile, so the session still brings figures back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/gpu_session}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"
} 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  start=$(date +%s)
  timeout "${PYTEST_TIMEOUT:-240}" "$PY" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -rA \
    $("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${TEST_TIMEOUT:-90}") 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
  echo "pytest -m gpu: $(( $(date +%s) - start )) s"
fi
if [ -n "${PROFILE_SIZE:-}" ]; then  # where a decode token's time and host syncs go (gpu_profile.py), before the bench
  timeout "${PROFILE_TIMEOUT:-150}" "$PY" benchmarks/gpu_profile.py --size "$PROFILE_SIZE" --out "$OUT" 2>&1 \
    | grep -v -E "Warning|forward_call|outputs = func" | tail -40
fi
bench() {
  timeout "$1" "$PY" benchmarks/gpu_bench.py --out "$OUT" "${@:2}" 2>&1 \
    | grep -v -E "FutureWarning|outputs = func|generation_config|deprecated" | tee -a "$OUT/bench.log"
}
start=$(date +%s)
bench "${BENCH_TIMEOUT:-330}" "$@"
rc=$?
took=$(( $(date +%s) - start ))
if [ $rc != 0 ] && [ $took -lt 90 ]; then
  echo "gpu_bench.py failed after $took s (rc $rc): again with --no-compile" | tee -a "$OUT/bench.log"
  bench $(( ${BENCH_TIMEOUT:-330} - took )) "$@" --no-compile
fi

#!/usr/bin/env bash
# One CPU machine kind's figures in one command: what docs/backends.md's "Machines measured" holds for each kind
# (both runners' pass costs taken in turns, where a pass's time goes and the GB/s each weight type streams against
# the bandwidth probe, the kernels' own rates, prompt processing, the draft models' passes, the held-out bench).
#   bash benchmarks/cpu_session.sh
# Writes under $OUT (default artifacts/cpu_session/<CPU family-model>-<date>): env.txt (lscpu, compiler, kernel path
# and tile, the probe), one log a stage, pass-cost JSON files and plots, bench/ (bench.md, bench.json, plots), and
# summary.md, each stage's headline lines in one page. STAGES picks and orders stages (default: all, as below);
# THREADS (2), MODEL (the default target), STAGE_TIMEOUT (600 s, each stage) and BENCH_TIMEOUT (1800 s) bound it.
# Where llama-cpp-python is installed (scripts/install-llamacpp.sh) llama.cpp is measured beside verispec in every
# stage that has it; without it those parts are left out, and env.txt says so. Every figure is a timing: run nothing
# else on these cores meanwhile (no test suite, no second benchmark). About 30 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
THREADS=${THREADS:-2}
MODEL=${MODEL:-qwen2.5-coder-1.5b-instruct}
STAGES=${STAGES:-"passes profile kernels prefill drafts bench"}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-600}
for stage in $STAGES; do
  case $stage in passes|profile|kernels|prefill|drafts|bench) ;;
    *) echo "cpu_session.sh: no stage '$stage' (stages: passes profile kernels prefill drafts bench)" >&2; exit 2 ;;
  esac
done
case $THREADS in ''|*[!0-9]*|0) echo "cpu_session.sh: THREADS must be a positive number, not '$THREADS'" >&2; exit 2 ;; esac
kind=$(lscpu | awk -F: '/^CPU family/ {gsub(/ /, "", $2); f=$2} /^Model:/ {gsub(/ /, "", $2); m=$2} END {print f "-" m}')
OUT=${OUT:-artifacts/cpu_session/$(lscpu | awk -F: '/^Vendor ID/ {gsub(/ /, "", $2); print $2}')-$kind-$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if "$PY" -c "import llama_cpp" 2>/dev/null; then LLAMACPP=1; else LLAMACPP=0; fi
{
  date -u
  lscpu
  gcc --version | head -1
  "$PY" - "$THREADS" <<'EOF'
import sys
import verispec
from verispec.bench.runner import memory_bandwidth_gbs
from verispec.models.gguf import native, tiles
native.lib().vs_set_threads(int(sys.argv[1]))
tiles.apply(int(sys.argv[1]))
print(f"verispec {verispec.__version__}; native kernel path {native.path()}, widest tile {tiles.in_force()}; "
      f"bandwidth probe {memory_bandwidth_gbs():.1f} GB/s")
EOF
  [ $LLAMACPP = 1 ] && echo "llama-cpp-python $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')" \
    || echo "llama-cpp-python not installed: llama.cpp's figures left out (bash scripts/install-llamacpp.sh)"
} > "$OUT/env.txt" 2>&1
grep -E "Model name|^CPU family|^Model:|verispec|llama" "$OUT/env.txt"
summary="$OUT/summary.md"
{ echo "# CPU session: $(grep -m1 'Model name' "$OUT/env.txt" | sed 's/.*: *//') (family-model $kind), $THREADS threads"
  echo; grep -E "^verispec|^llama" "$OUT/env.txt"; } > "$summary"

# run NAME TIMEOUT CMD...: the command's output into NAME.log (and the terminal), bounded; says how it ended
run() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > >(tee -a "$OUT/$name.log") 2>&1
  rc=$?
  echo "[$name: rc $rc, $(( $(date +%s) - start )) s]" | tee -a "$OUT/$name.log"
  [ $rc = 124 ] && echo "[$name: stopped at its ${limit} s limit]" | tee -a "$OUT/$name.log"
  return 0
}
section() { { echo; echo "## $1"; echo; echo '```text'; grep -E "$3" "$OUT/$2.log"; echo '```'; } >> "$summary"; }

for stage in $STAGES; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    passes)  # v(k) for both runners, the widths in turns (a step between widths is the kernels', not the minute's)
      run passes "$STAGE_TIMEOUT" "$PY" benchmarks/pass_costs.py --model "$MODEL" --backend native --threads "$THREADS" \
        --max-tokens 16 --repeats 9 --interleave --json "$OUT/passes-native.json" --plot "$OUT/passes-v.png"
      if [ $LLAMACPP = 1 ] && [ -f "$OUT/passes-native.json" ]; then  # its curve drawn over the native one
        run passes "$STAGE_TIMEOUT" "$PY" benchmarks/pass_costs.py --model "$MODEL" --backend llama.cpp \
          --threads "$THREADS" --max-tokens 16 --repeats 9 --interleave --json "$OUT/passes-llamacpp.json" \
          --overlay "$OUT/passes-native.json" --plot "$OUT/passes-v.png"
      fi
      section "Pass costs, widths in turns (native, then llama.cpp)" passes "tokens: .* v =|^\[passes"
      ;;
    profile)  # where a pass's time goes, and each weight type's GB/s against the probe
      run profile "$STAGE_TIMEOUT" "$PY" benchmarks/pass_costs.py --model "$MODEL" --backend native --threads "$THREADS" \
        --max-tokens 8 --repeats 9 --profile --widths 1,4,8 --plot-profile "$OUT/profile.png"
      section "Where a native pass goes; GB/s against the probe" profile " tokens: .*(=|GB/s)|^memory bandwidth"
      ;;
    kernels)  # the kernels' own rates: weights in cache (arithmetic) and a pass's matmuls streamed
      run kernels "$STAGE_TIMEOUT" "$PY" benchmarks/kernel_rates.py --model "$MODEL" --threads "$THREADS" --widths 1,4,8
      if grep -qE "native kernel path (avx512-vnni|amx)," "$OUT/env.txt"; then  # is this CPU's default the faster?
        run kernels "$STAGE_TIMEOUT" "$PY" benchmarks/pass_costs.py --model "$MODEL" --backend native \
          --threads "$THREADS" --prefetch-one --repeats 40
      fi
      section "Kernel rates (hot: in cache; streamed: a pass's matmuls); one-token prefetching on and off" kernels \
        "^kernel path|tokens, (hot|streamed)|^one-token pass"
      ;;
    prefill)
      run prefill "$STAGE_TIMEOUT" "$PY" benchmarks/prefill.py --model "$MODEL" --threads "$THREADS" --lengths 128,512 \
        --repeats 3 --json "$OUT/prefill.json"
      section "Prompt processing" prefill "^\|"
      ;;
    drafts)  # the draft models' one-token passes against their bandwidth cost
      for draft in smollm2-135m-instruct gemma-3-270m qwen2.5-coder-0.5b-instruct; do
        echo "-- $draft" >> "$OUT/drafts.log"
        run drafts "$STAGE_TIMEOUT" "$PY" benchmarks/pass_costs.py --model "$draft" --backend native --threads "$THREADS" \
          --max-tokens 2 --repeats 31 --profile --widths 1,2
      done
      section "Draft models (one-token pass; GB/s against the probe)" drafts "^-- |^  1 tokens: |^memory bandwidth"
      ;;
    bench)  # held-out Spec-Bench, greedy, decoding after the first output against llama.cpp's plain decoding
      systems=verispec-plain,verispec-suffix-auto
      [ $LLAMACPP = 1 ] && systems=llamacpp-generate,$systems
      run bench "${BENCH_TIMEOUT:-1800}" "$PY" -m verispec bench --target "$MODEL" --split heldout --per-category 1 \
        --max-new-tokens 128 -k 4 --threads "$THREADS" --systems "$systems" --out "$OUT/bench"
      { echo; echo "## Held-out bench (bench/bench.md has every table)"; echo
        [ -f "$OUT/bench/bench.md" ] && sed -n '/^median decoding/,/^tokens per target/p' "$OUT/bench/bench.md" | sed '$d'
        [ -f "$OUT/bench/bench.md" ] && sed -n '/^| system | acceptance/,/^$/p; /^memory bandwidth/p' "$OUT/bench/bench.md"
      } >> "$summary"
      ;;
  esac
done
echo "== done: $OUT (summary.md)"
cat "$summary"

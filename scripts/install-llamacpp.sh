#!/usr/bin/env bash
# Builds the llama.cpp backend's Python binding (llama-cpp-python) from source with the machine's compiler, for
# this machine's CPU, and installs it into .venv. About 10 minutes on 2 cores the first time; the wheel is kept in
# ~/.cache/verispec, keyed by the CPU's feature flags (a native build must not run on another CPU), so that a later
# fresh clone on the same machine installs it in seconds. A no-op when it is already installed.
# AMX code is left out: on Intel Xeons with AMX a native build died with a general protection fault, and on
# VMs that hide AMX with "Illegal instruction" (../shared/NOTES.md); AVX-512 / AVX2 are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
VERSION=0.3.36
if "$VPY" -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
KEY=$( (grep -m1 '^flags' /proc/cpuinfo; gcc -dumpfullversion; echo "$VERSION") | sha256sum | cut -c1-16)
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/verispec/llama-cpp-python/$KEY"
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION for this CPU (about 10 minutes on 2 cores; once per machine)"
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$VPY" -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir "$BUILD" "llama-cpp-python==$VERSION"
  mkdir -p "$WHEELS"
  mv "$BUILD"/llama_cpp_python-*.whl "$WHEELS"/  # only a finished wheel lands in the cache
fi
"$VPY" -m pip install --quiet "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl

#!/usr/bin/env bash
# Builds llama.cpp into .llamacpp/ (ignored): the source vendored in the PyPI sdist llama-cpp-python
# (pinned), cmake Release, GGML_NATIVE on (the engine a CPU user builds for their own CPU), no curl, no
# OpenSSL, no web UI. Targets: llama-bench, llama-server, llama-speculative-simple, llama-cli,
# llama-quantize, llama-lookup. The build's stamp (.llamacpp/BUILD.json: sdist version, cmake options,
# the CPU's model and instruction-set flags) lets draftsmith refuse a build made on another CPU kind
# (a GGML_NATIVE binary from an AVX-512 machine dies with an illegal instruction on an AVX2 one).
# Its Python pieces (gguf-py, convert_hf_to_gguf.py) are used from the same tree; sentencepiece and the
# build tools (cmake, ninja) come from the package registry into .venv.
# Runs once: a second run with the same stamp does nothing. LLAMACPP_FORCE=1 rebuilds.
# Output: one line a step; a failing step stops the script.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=${LLAMACPP_SDIST_VERSION:-0.3.36}
DEST="$ROOT/.llamacpp"
JOBS=${JOBS:-$(nproc)}
TARGETS="llama-bench llama-server llama-speculative-simple llama-cli llama-quantize llama-lookup"
CMAKE_OPTS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DGGML_CCACHE=OFF"
# llama.cpp's AMX path (ggml-cpu/amx) runs tile instructions on worker threads that never asked the kernel for
# the AMX tile state (only the main thread asks), so on a CPU with AMX a forward of more than one token dies with
# SIGILL (seen on a 2-core Xeon: `llama-bench -p 2`, every llama-server prompt). There the build leaves AMX out
# (-mno-amx-*); its AVX-512 kernels (VNNI, BF16) stay.
NO_AMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
EXTRA=()
[ -z "$NO_AMX" ] || EXTRA=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
STEP="start"
trap 'echo "llamacpp_env.sh: FAILED at step \"$STEP\" (exit $?)" >&2' ERR
step() { STEP=$*; echo "llamacpp_env: $*"; }
[ -x "$PY" ] || { echo "llamacpp_env.sh: $PY not found; run scripts/setup.sh first" >&2; exit 2; }
mkdir -p "$DEST"
STAMP=$("$PY" -c '
import json, sys
from draftsmith.machine import cpu_stamp
print(json.dumps({"sdist": f"llama-cpp-python=={sys.argv[1]}", "cmake": sys.argv[2].split(),
                  "cflags": sys.argv[4], "targets": sys.argv[3].split(), **cpu_stamp()}, sort_keys=True))' \
  "$VERSION" "$CMAKE_OPTS" "$TARGETS" "$NO_AMX")
if [ -z "${LLAMACPP_FORCE:-}" ] && [ -f "$DEST/BUILD.json" ] && [ "$(cat "$DEST/BUILD.json")" = "$STAMP" ]; then
  echo "llamacpp_env: up to date ($DEST/BUILD.json matches this CPU and pin); LLAMACPP_FORCE=1 rebuilds"
  exit 0
fi
rm -f "$DEST/BUILD.json"
pipq() {
  "$PY" -m pip install -q "$@" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" -e "dependency resolver" \
    -e "^nvidia-mtbench-evaluator .* requires" -e "^$" || true; }
}
step "build tools cmake, ninja; sentencepiece for the converter (package registry, into .venv)"
pipq cmake ninja sentencepiece
export PATH="$(dirname "$PY"):$PATH"
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if [ ! -f "$DEST/llama_cpp_python-$VERSION.tar.gz" ]; then
    step "fetch the sdist llama-cpp-python==$VERSION (no dependencies; about a minute)"
    "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DEST" 2>&1 \
      | { grep -v -e "is ignored: it is neither a file nor a directory" || true; } | tail -n 3
  fi
  step "unpack vendor/llama.cpp"
  tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
step "configure ($CMAKE_OPTS${NO_AMX:+ C/C++ flags: $NO_AMX})"
cmake -S "$SRC" -B "$DEST/build" -G Ninja $CMAKE_OPTS "${EXTRA[@]}" > "$DEST/configure.log" 2>&1 \
  || { tail -n 30 "$DEST/configure.log" >&2; false; }
step "compile $TARGETS on $JOBS jobs (a few minutes to a quarter hour; log: $DEST/build.log)"
cmake --build "$DEST/build" -j "$JOBS" --target $TARGETS > "$DEST/build.log" 2>&1 \
  || { tail -n 40 "$DEST/build.log" >&2; false; }
step "smoke: llama-cli --version"
"$DEST/build/bin/llama-cli" --version 2>&1 | head -n 2
ln -sfn "$SRC" "$DEST/src"
echo "$STAMP" > "$DEST/BUILD.json"
echo "llamacpp_env: ready: $DEST/build/bin ($(echo $TARGETS | wc -w) programs), source $DEST/src"

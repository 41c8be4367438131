#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): losslessness on CUDA, step costs as a `draftsmith simulate` profile,
# training throughput per kind and one `accelerate launch`. Usage, from the repository root:
#
#   bash scripts/gpu_check.sh OUT_DIR [gpu_check options]        # e.g. --budget-s 360, --sections exact shape
#   bash scripts/gpu_check.sh OUT_DIR --device cpu --quick        # the CPU rehearsal
#
# Runs with .venv's python when there is one; else with the machine's python3, which must have torch,
# transformers, accelerate, peft and safetensors (a lent GPU machine has them): wheels of anything else it lacks
# (pydantic) are installed from .whl/ when that folder exists, and draftsmith is put on the path without an
# install (a folder of links mapping the package's folders, as setup.py does). Writes OUT_DIR/gpu_check.json,
# OUT_DIR/gpu_profile_<dtype>.yaml and OUT_DIR/gpu_check.log; exit status 1 when any case failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [options]}
shift
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=$ROOT/.venv/bin/python
if [ -n "${GPU_CHECK_SHIM:-}" ] || ! "$PY" -c "import draftsmith" 2>/dev/null; then
  SITE=$(mktemp -d /tmp/draftsmith_site.XXXX)
  if ! "$PY" -c "import pydantic" 2>/dev/null && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/deps" .whl/*.whl \
      || { echo "gpu_check.sh: installing the wheels in .whl/ failed" >&2; exit 2; }
  fi
  # draftsmith = core/, draftsmith.NAME = FOLDER/: read from setup.py's FOLDERS, so that no subpackage is missing
  # here (one was: every `draftsmith.cli` call failed on the GPU while the CPU rehearsal, installed, passed)
  SUBS=$("$PY" scripts/package_folders.py) || { echo "gpu_check.sh: setup.py's FOLDERS not read" >&2; exit 2; }
  mkdir -p "$SITE/pkg/draftsmith"
  for f in core/*.py; do ln -s "$ROOT/$f" "$SITE/pkg/draftsmith/"; done
  for pair in $SUBS; do ln -s "$ROOT/${pair#*=}" "$SITE/pkg/draftsmith/${pair%%=*}"; done
  export PYTHONPATH="$SITE/pkg:$SITE/deps:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  (cd /tmp && "$PY" "$ROOT/scripts/package_folders.py" --import) \
    || { echo "gpu_check.sh: draftsmith does not import through the links" >&2; exit 2; }
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline DRAFTSMITH_FORWARD=${DRAFTSMITH_FORWARD:-fast}
"$PY" -m benchmarks.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"

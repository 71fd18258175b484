"""docs/lmdeploy_commands.md: the rows that finish before a model loads (LMDeploy's spellings the
CLI refuses or takes, --help, list, the benchmarks' options) still do what the table says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lmdeploy_parity.py"


def test_the_tables_quick_rows_still_hold() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BAD" not in done.stdout

"""wait_stages_healthy's failure says which stage had not come up: every stage's last log lines."""

import subprocess
import sys

import pytest

from conveyor.protocol.addresses import free_port
from conveyor.testing.server_process import wait_stages_healthy


def test_timeout_shows_every_stage_log() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    logs = {"engine": "loading weights\nstill loading"}
    try:
        with pytest.raises(AssertionError, match=r"(?s)never became healthy in 1 s\n--- engine:\n.*still loading"):
            wait_stages_healthy({"engine": proc}, f"http://127.0.0.1:{free_port()}", 0.6, "the test deployment",
                                logs.__getitem__)
    finally:
        proc.kill()
        proc.wait()

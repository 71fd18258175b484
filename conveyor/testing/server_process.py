"""Start a `conveyor serve api_server` process for tests and benchmarks, and find its stage processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ..protocol.addresses import free_port  # the tests import it from here too


def free_base_port() -> int:
    """A base port for the tcp:// stages whose stage ports (base+1..3) and ingress reply port
    (base+10) are free on 127.0.0.1 too."""
    return free_port((0, 1, 2, 3, 10))


def wait_stages_healthy(procs: dict[str, subprocess.Popen], url: str, timeout: float, what: str,
                        log: Callable[[str], str]) -> None:
    """Poll ``url``/health until it says 200 while asserting that every process of a deployment
    started stage by stage is still running (``log(name)``: that process' output, for the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited: {log(name)}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            # Every stage's last lines: which one had not come up, and what it was doing.
            tails = "\n".join(f"--- {name}:\n{log(name)[-1500:]}" for name in procs)
            raise AssertionError(f"{what} never became healthy in {timeout:.0f} s\n{tails}")
        time.sleep(0.3)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    """`conveyor serve api_server ...` in a subprocess, its log in a file. With ``engine_factory``
    ("module:callable", e.g. ``serve.FAKE_ENGINE``) the stages serve that callable's engine instead of
    ``LLMEngine`` (``python -m conveyor.testing.serve``)."""

    def __init__(self, model: str | Path, *extra: str, log_dir: Path, api_key: str | None = None,
                 start_timeout: float = 240.0, env: dict[str, str] | None = None, engine_factory: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        command = ["conveyor.cli", "serve"] if engine_factory is None else ["conveyor.testing.serve"]
        args = [sys.executable, "-m", *command, "api_server", str(model),
                "--server-name", "127.0.0.1", "--server-port", str(self.port), "--log-level", "INFO", *extra]
        if engine_factory is not None:
            args += ["--engine-factory", engine_factory]
        if api_key:
            args += ["--api-keys", api_key]
        self._log = open(self.log_path, "w")
        # A checkout's root on the path: an engine factory may name a module of benchmarks/
        # (benchmarks.timed_engine:build).
        root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))  # env: for a child process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        # The last --log-level wins (a test may pass WARNING): the launcher's INFO lines (the
        # stages' pids, "serving") are in the log only at INFO.
        self._logs_info = args[len(args) - 1 - args[::-1].index("--log-level") + 1].upper() == "INFO"
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        from ..serving import wait_until_healthy

        deadline = time.monotonic() + timeout
        try:
            wait_until_healthy(self.proc, self.url, timeout)
            # The ingress says READY only once it listens, so /health can answer before the
            # launcher has read that READY: wait for its "serving" line, after which every
            # stage's "ready (pid N)" line is in the log (tests read pids from there).
            while self._logs_info and not re.search(r"INFO serving \S+ on http://", self.log()):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the launcher never said it serves")
                time.sleep(0.05)
        except RuntimeError as exc:
            self.kill()
            raise RuntimeError(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        """Everything the server printed so far (also once it has stopped)."""
        if not self._log.closed:  # terminate closes it
            self._log.flush()
        return self.log_path.read_text()

    def stage_pids(self, stage: str) -> list[int]:
        """Pids of a stage ('engine', 'tokenizer', ...) from the launcher's READY log lines."""
        return [int(p) for p in re.findall(rf"INFO (?<![a-z]){stage} ready \(pid (\d+)\)", self.log())]

    def rank_pids(self) -> list[int]:
        """Pids of the tensor-parallel ranks every engine started (rank 0 is the engine stage)."""
        return [int(p) for p in re.findall(r"started tensor-parallel rank \d+ \(pid (\d+)\)", self.log())]

    def run_dir(self) -> Path:
        """The private directory holding the stages' ipc sockets (from the launcher's log)."""
        return Path(re.search(r"stage sockets in (\S+)", self.log()).group(1))

    def headers(self) -> dict[str, str]:
        """The Authorization header, when the server has a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM the launcher and wait for every process to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """Kill the whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

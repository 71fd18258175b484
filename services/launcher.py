"""Starts a whole deployment: every stage as its own process over ``ipc://`` (or ``tcp://``).

Order: engine (slowest: loads weights), detokenizer and tokenizer workers, all saying READY;
then the HTTP ingress. The launcher then supervises: SIGTERM/SIGINT drains the ingress (in
flight requests finish, new ones get 503), then stops every other stage. A dead tokenizer
worker is logged and the others carry on; a dead engine makes the ingress answer 503.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from ..engine.config import EngineConfig
from ..protocol import Addresses, Codec, Stage
from ..protocol.messages import LauncherIn
from .detokenizer.process import run_detokenizer_process
from .engine.process import run_engine_process
from .ingress.process import run_ingress_process
from .tokenizer.process import run_tokenizer_process

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    """Settings of ``conveyor serve api_server``."""

    model_path: str
    server_name: str = "0.0.0.0"
    server_port: int = 23333
    tokenizer_workers: int = 1
    api_keys: list[str] | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    log_level: str = "INFO"
    start_timeout: float = 600.0
    drain_timeout: float = 60.0  # on SIGTERM, how long requests in flight may run before the stop
    # "module:callable" building the engine instead of LLMEngine (the stack benchmark and fault
    # tests use benchmarks.fake_engine:build, an engine without a model)
    engine_factory: str | None = None


class Deployment:
    """The processes of one server; ``start()`` returns once the ingress accepts HTTP."""

    def __init__(self, args: ServerArgs, addresses: Addresses | None = None):
        self.args = args
        self.addresses = addresses or Addresses.ipc()
        self._mp = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PULL)
        self._ready.bind(self.addresses.launcher.bind)
        self._codec = Codec(LauncherIn)
        self.engine_info: dict = {}

    def _spawn(self, name: str, target, *args) -> None:
        proc = self._mp.Process(target=target, args=args, name=f"conveyor-{name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def _wait_ready(self, expected: dict[Stage, int]) -> None:
        deadline = time.monotonic() + self.args.start_timeout
        remaining = dict(expected)
        while any(remaining.values()):
            for name, proc in self.procs.items():
                if not proc.is_alive():
                    raise RuntimeError(f"stage {name} exited with code {proc.exitcode} while starting; see its log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"stages not ready after {self.args.start_timeout}s: {remaining}")
            if self._ready.poll(200):
                msg = self._codec.recv(self._ready)
                remaining[msg.stage] = remaining.get(msg.stage, 0) - 1
                if msg.stage == Stage.ENGINE:
                    self.engine_info = dict(msg.info)
                logger.info("%s ready (pid %d)", msg.stage.name.lower(), msg.pid)

    def start(self) -> None:
        """Start every stage and wait until each said READY."""
        a, args, launcher = self.addresses, self.args, self.addresses.launcher.connect
        if a.kind == "ipc":
            logger.info("stage sockets in %s", a.run_dir)
        self._spawn("engine", run_engine_process, a, args.model_path, args.engine, launcher, args.log_level,
                    args.engine_factory)
        self._spawn("detokenizer", run_detokenizer_process, a, args.model_path, launcher, args.log_level)
        self._wait_ready({Stage.ENGINE: 1, Stage.DETOKENIZER: 1})
        session_len = int(self.engine_info["session_len"])
        for i in range(args.tokenizer_workers):
            self._spawn(f"tokenizer-{i}", run_tokenizer_process, a, args.model_path, session_len,
                        args.chat_template, launcher, args.log_level)
        self._wait_ready({Stage.TOKENIZER: args.tokenizer_workers})
        name = args.served_model_name or args.model_path.rstrip("/").split("/")[-1]
        self._spawn("ingress", run_ingress_process, a, args.model_path, name, session_len, args.server_name,
                    args.server_port, args.api_keys, launcher, args.log_level, args.drain_timeout)
        self._wait_ready({Stage.INGRESS: 1})
        logger.info("serving %s on http://%s:%d", name, args.server_name, args.server_port)

    def stop(self) -> None:
        """Drain the ingress, then stop the other stages; every process is gone on return."""
        ingress = self.procs.get("ingress")
        if ingress is not None and ingress.is_alive():
            ingress.terminate()  # SIGTERM: the ingress drains, then exits
            ingress.join(self.args.drain_timeout + 10)
        for name, proc in self.procs.items():
            if proc.is_alive():
                proc.terminate()
        for name, proc in self.procs.items():
            proc.join(10)
            if proc.is_alive():
                logger.warning("%s did not stop; killing it", name)
                proc.kill()
                proc.join()
        self._ready.close(linger=0)
        self._ctx.term()
        if self.addresses.kind == "ipc" and self.addresses.run_dir:
            shutil.rmtree(self.addresses.run_dir, ignore_errors=True)  # the sockets' private directory

    def watch(self, stop: threading.Event) -> None:
        """Log stages that die until ``stop`` is set or the ingress exits."""
        dead: set[str] = set()
        while not stop.wait(1.0):
            for name, proc in self.procs.items():
                if name not in dead and not proc.is_alive():
                    dead.add(name)
                    logger.error("stage %s exited (code %s)", name, proc.exitcode)
            if "ingress" in dead:
                return


def serve(args: ServerArgs) -> int:
    """Run a server in the foreground until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    deployment = Deployment(args)
    try:
        deployment.start()
        deployment.watch(stop)
    finally:
        deployment.stop()
    return 0

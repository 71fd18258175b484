"""Starts a whole deployment: every stage as its own process over ``ipc://`` (or ``tcp://``).

Order: engine (slowest: loads weights), detokenizer and tokenizer workers, all saying READY;
then the HTTP ingress. The launcher then supervises: a stage that dies is restarted after a
backoff (0.5 s, doubling, at most 10 s) and the ingress is told at once (StageStatus): while
the engine or the detokenizer is down, requests get 503 and the ones in flight end with an
error (their state died with the stage); /health names the stages that are down. A stage that
dies more than RESTART_BUDGET times in RESTART_WINDOW_S makes the launcher stop everything and
exit 1, so that an outer supervisor (systemd, compose ``restart:``) sees it.
SIGTERM/SIGINT drains the ingress (in-flight requests finish, new ones get 503), then stops
every other stage and exits 0. When the ingress dies, the engine is told at once (IngressGone)
and aborts the requests it sent. The launcher hands every stage a secret token
(``Addresses.launcher_token``): it takes a READY only from a process it started that carries it,
and its own notices carry it, so a peer that can write to a socket cannot fake a stage's birth
or death. Stages end when the launcher does, however it ended (``stage.exit_with_launcher``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from ..engine.config import EngineConfig
from ..protocol import Addresses, Codec, EngineIn, IngressGone, IngressIn, LauncherIn, Stage, StageStatus, security
from .detokenizer.process import run_detokenizer_process
from .engine.process import run_engine_process
from .ingress.limits import IngressLimits
from .ingress.process import run_ingress_process
from .ingress.qos import QosConfig
from .stage import open_socket
from .tokenizer.images import ImageLimits
from .tokenizer.process import run_tokenizer_process

logger = logging.getLogger(__name__)

RESTART_BUDGET = 5  # restarts of one stage within RESTART_WINDOW_S before the launcher gives up
RESTART_WINDOW_S = 60.0


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
    max_restarts: int = RESTART_BUDGET  # restarts of one stage within RESTART_WINDOW_S; one more: exit 1
    limits: IngressLimits = field(default_factory=IngressLimits)  # what one client may ask of the ingress
    qos: QosConfig | None = None  # user groups: priorities and quotas (--qos-config-path)
    proxy_url: str | None = None  # a proxy (conveyor serve proxy) the ingress joins while it serves
    proxy_admin_key: str | None = field(default=None, repr=False)  # the proxy's admin key it joins with
    tool_call_parser: str | None = None  # the chat route's tool-call format (None: the chat template's)
    reasoning_parser: str | None = None  # the chat route's reasoning split (None: none)
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # what a request's images may be
    # "module:callable" building the engine instead of LLMEngine: no product flag sets it; tests and
    # benchmarks do (conveyor.testing.serve; its default is the model-free conveyor.testing.fake_engine).
    # A name, not the callable: the engine stage is a spawned process, which imports it.
    engine_factory: str | None = None


class Deployment:
    """The processes of one server; ``start()`` returns once the ingress accepts HTTP."""

    def __init__(self, args: ServerArgs, addresses: Addresses | None = None):
        self.args = args
        addresses = addresses or Addresses.ipc()
        if not addresses.launcher_token:
            addresses = dataclasses.replace(addresses, launcher_token=secrets.token_hex(16))
        self.addresses = addresses
        self._mp = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self._ctx = zmq.Context()
        self._ready = open_socket(self._ctx, zmq.PULL, bind=self.addresses.launcher.bind, curve=self.addresses.curve)
        self._codec = Codec(LauncherIn)
        self.engine_info: dict = {}
        self._specs: dict[str, tuple] = {}  # name -> (target, args): how to start it again
        self._restarts: dict[str, list[float]] = {}  # name -> when it was restarted
        self._restart_at: dict[str, float] = {}  # dead stages waiting out their backoff
        self._to_ingress: zmq.Socket | None = None  # StageStatus to the ingress's reply address
        self._status_codec = Codec(IngressIn)
        self._ingress_reply_to: str | None = None  # the running ingress's address (IngressGone names it)
        self._to_engine = open_socket(self._ctx, zmq.PUSH, connect=self.addresses.engine_in.connect,
                                      curve=self.addresses.curve)
        self._engine_codec = Codec(EngineIn)
        self.refused_ready = 0  # READY frames from a process that is not a stage of ours, or without the token
        self._reported: dict[str, float] = {}  # the counters the ingress last got

    def _spawn(self, name: str, target, *args) -> None:
        self._specs[name] = (target, args)
        proc = self._mp.Process(target=target, args=(name, *args), name=f"conveyor-{name}", daemon=False)
        proc.start()
        self.procs[name] = proc
        logger.info("started stage %s (pid %d)", name, proc.pid)

    def _on_ready(self, msg) -> bool:
        """A stage said READY: log it, and for the ingress, where to send stage news. False: the
        message was not from a stage of ours (ignored)."""
        name = next((n for n, p in self.procs.items() if p.pid == msg.pid), None)
        why = ("not a stage of this launcher" if name is None
               else "without the launcher token" if not self.addresses.is_launcher_token(msg.token)
               else f"naming stage {msg.stage.name} for {name}" if name.split("-")[0] != msg.stage.name.lower()
               else None)
        if why is not None:
            self.refused_ready += 1
            logger.warning("ignored a READY from pid %d: %s (%d so far)", msg.pid, why, self.refused_ready)
            return False
        logger.info("%s ready (pid %d)", msg.stage.name.lower(), msg.pid)
        if msg.stage == Stage.ENGINE:
            self.engine_info = dict(msg.info)
        if msg.stage == Stage.INGRESS and msg.info.get("reply_to"):
            if self._to_ingress is not None:
                self._to_ingress.close(linger=0)
            if not self.addresses.is_reply_address(msg.info["reply_to"]):
                logger.warning("ingress named %r as its address, not one of this deployment's", msg.info["reply_to"])
                return True
            self._to_ingress = open_socket(self._ctx, zmq.PUSH, connect=msg.info["reply_to"],
                                           curve=self.addresses.curve)
            self._ingress_reply_to = msg.info["reply_to"]
        if self._restarts.get(name):
            self._tell_ingress(name, True, msg.pid)
        return True

    def _tell_ingress(self, name: str, up: bool, pid: int) -> None:
        if self._to_ingress is not None:
            try:
                kind = name.split("-")[0]
                peers = sum(1 for n in self.procs if n.split("-")[0] == kind)
                self._status_codec.send(self._to_ingress, StageStatus(name, up, pid, len(self._restarts.get(name, [])),
                                                                      self.addresses.launcher_token, peers=peers),
                                        zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("could not tell the ingress that %s is %s", name, "up" if up else "down")

    def _report_counters(self) -> None:
        """Send the launcher's own counters to the ingress when they changed (its /metrics
        shows them as ``launcher_*`` stage stats): frames on its socket that did not decode, and
        READYs it refused."""
        stats = {"launcher_bad_frames": float(self._codec.dropped), "launcher_refused_ready": float(self.refused_ready)}
        if stats == self._reported or self._to_ingress is None:
            return
        try:
            self._status_codec.send(self._to_ingress, StageStatus("launcher", True, os.getpid(), 0,
                                                                  self.addresses.launcher_token, stats), zmq.NOBLOCK)
            self._reported = stats
        except zmq.Again:
            pass  # told next time

    def _ingress_died(self) -> None:
        """The ingress is gone: the engine aborts what it sent (nobody reads those answers now),
        rather than generating each to its max_tokens while holding KV blocks and batch slots."""
        if self._ingress_reply_to is None:
            return
        try:
            self._engine_codec.send(self._to_engine, IngressGone(self._ingress_reply_to, self.addresses.launcher_token),
                                    zmq.NOBLOCK)
        except zmq.Again:  # the engine is down too: its requests died with it
            logger.warning("could not tell the engine that the ingress is gone")
        self._ingress_reply_to = None

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
                for msg in self._codec.recv_all(self._ready):
                    if self._on_ready(msg):
                        remaining[msg.stage] = remaining.get(msg.stage, 0) - 1

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
                        args.chat_template, launcher, args.log_level, args.image_limits)
        self._wait_ready({Stage.TOKENIZER: args.tokenizer_workers})
        name = args.served_model_name or args.model_path.rstrip("/").split("/")[-1]
        self._spawn("ingress", run_ingress_process, a, args.model_path, name, session_len, args.server_name,
                    args.server_port, args.api_keys, launcher, args.log_level, args.drain_timeout, args.limits,
                    args.qos, args.proxy_url, args.proxy_admin_key, args.chat_template, args.tool_call_parser,
                    args.reasoning_parser, args.engine.adapters)
        self._wait_ready({Stage.INGRESS: 1})
        logger.info("serving %s on http://%s:%d", name, args.server_name, args.server_port)

    def stop(self) -> None:
        """Drain the ingress, then stop the other stages; every process is gone on return."""
        ingress = self.procs.get("ingress")
        if ingress is not None and ingress.is_alive():
            ingress.terminate()  # SIGTERM: the ingress drains, then exits
            ingress.join(self.args.drain_timeout + 10)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for name, proc in self.procs.items():
            proc.join(10)
            if proc.is_alive():
                logger.warning("%s did not stop; killing it", name)
                proc.kill()
                proc.join()
        self._ready.close(linger=0)
        self._to_engine.close(linger=0)
        if self._to_ingress is not None:
            self._to_ingress.close(linger=0)
        security.release(self._ctx)
        self._ctx.term()
        if self.addresses.kind == "ipc" and self.addresses.run_dir:
            shutil.rmtree(self.addresses.run_dir, ignore_errors=True)  # the sockets' private directory

    def watch(self, stop: threading.Event) -> int:
        """Restart stages that die until ``stop`` is set; returns the exit code (1: a stage kept
        dying, past its restart budget)."""
        while not stop.wait(0.2):
            for msg in self._codec.recv_all(self._ready):
                self._on_ready(msg)
            self._report_counters()
            now = time.monotonic()
            for name, proc in self.procs.items():
                if proc.is_alive() or name in self._restart_at:
                    continue
                recent = [t for t in self._restarts.get(name, []) if now - t < RESTART_WINDOW_S]
                self._restarts[name] = recent
                if name == "ingress":
                    self._ingress_died()
                self._tell_ingress(name, False, proc.pid)
                if len(recent) >= self.args.max_restarts:
                    logger.error("stage %s (pid %d) exited with code %s, its %d restart in %.0fs: giving up",
                                 name, proc.pid, proc.exitcode, len(recent) + 1, RESTART_WINDOW_S)
                    return 1
                delay = min(0.5 * 2 ** len(recent), 10.0)
                logger.error("stage %s (pid %d) exited with code %s; restarting it in %.1fs",
                             name, proc.pid, proc.exitcode, delay)
                self._restart_at[name] = now + delay
            for name, when in list(self._restart_at.items()):
                if now >= when:
                    del self._restart_at[name]
                    self._restarts[name].append(now)
                    target, args = self._specs[name]
                    self._spawn(name, target, *args)
        return 0


def serve(args: ServerArgs) -> int:
    """Run a server in the foreground until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    deployment = Deployment(args)
    try:
        deployment.start()
        code = deployment.watch(stop)
    finally:
        deployment.stop()
    return code

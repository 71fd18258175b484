"""What every stage process shares: logging set-up, the READY handshake, SIGTERM, reply sockets."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading

import msgspec
import zmq

from ..protocol import Addresses, Codec, ErrorOut, Ready, Stage
from ..protocol.messages import IngressIn, LauncherIn
from ..protocol.security import CurveKeys
from . import stack_sampler

logger = logging.getLogger(__name__)


def setup_logging(level: str = "INFO") -> None:
    """One log format for every stage process."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def announce_ready(ctx: zmq.Context, launcher_address: str | None, stage: Stage, addresses: Addresses,
                   **info) -> None:
    """Tell the launcher this stage accepts traffic (no launcher: nothing to do)."""
    if not launcher_address:
        return
    # A READY dropped at close leaves a restarted stage unannounced for good; on a starved 2-core
    # machine the connection can take seconds, so wait long (the launcher is there: it started us).
    sock = open_socket(ctx, zmq.PUSH, connect=launcher_address, linger_ms=30_000, curve=addresses.curve)
    Codec(LauncherIn).send(sock, Ready(stage, os.getpid(), info, addresses.launcher_token))
    sock.close()


SEND_TIMEOUT_MS = 2000  # a send on the request path waits at most this long for its peer


def open_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None,
                linger_ms: int = 0, send_timeout_ms: int = -1, send_hwm: int | None = None,
                curve: CurveKeys | None = None) -> zmq.Socket:
    """A socket bound or connected to one address, with its linger time (how long unsent
    messages are kept at close), send timeout (-1: wait; else a send raises zmq.Again), send
    queue bound, and the deployment's CURVE keys (tcp://: a bound socket admits only key holders)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    if send_hwm is not None:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
    if curve is not None:
        curve.secure(sock, server=bind is not None)
    if bind is not None:
        sock.bind(bind)
    if connect is not None:
        sock.connect(connect)
    return sock


def internal_error(rid: str, stage: str) -> ErrorOut:
    """What a client is told of a stage's own failure: no exception text (it may hold internals),
    only the request id to find the logged traceback by."""
    return ErrorOut(rid, 500, f"internal error in the {stage} stage; the server log has the details under "
                              f"request id {rid}", type="internal_error", code="internal_error")


def begin_stage_process(name: str, log_level: str, addresses: Addresses | None = None,
                        launcher: str | None = None) -> None:
    """What a stage process does first: its log format, its title for ps (``conveyor: NAME``),
    when ``CONVEYOR_STACK_SAMPLES`` asks for it a stack sampler (``stack_sampler``), and, when a
    launcher started it, a watch that ends the stage with its launcher (``exit_with_launcher``)."""
    setup_logging(log_level)
    set_process_title(f"conveyor: {name}")
    stack_sampler.start_from_env(name)
    if launcher and addresses is not None:
        exit_with_launcher(name, addresses)


ORPHAN_GRACE_S = 15.0  # after its launcher died, how long a stage may take to stop before it is ended


def exit_with_launcher(name: str, addresses: Addresses, grace_s: float = ORPHAN_GRACE_S) -> threading.Thread | None:
    """End this stage when the launcher that started it dies, however it died (``kill -9``
    included: no signal reaches the stages then, and they would go on serving, re-parented to
    init, with nobody to restart or stop them). A thread waits on the launcher's process
    sentinel; when it fires, the socket directory is removed (its owner is gone) and the stage
    gets SIGTERM, stopping as it would on the launcher's word; if it has not exited after
    ``grace_s`` it is ended. A stage not started by ``multiprocessing`` (compose) has nothing to
    watch."""
    parent = mp.parent_process()
    if parent is None:
        return None

    def watch() -> None:
        parent.join()  # returns when the launcher's process has ended
        logger.error("%s: the launcher (pid %s) is gone; stopping this stage", name, parent.pid)
        if addresses.kind == "ipc" and addresses.run_dir:
            shutil.rmtree(addresses.run_dir, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(grace_s)
        logger.error("%s did not stop %.0fs after its launcher died; ending it", name, grace_s)
        logging.shutdown()
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def set_process_title(title: str) -> None:
    """Name this process for ps and top (``conveyor: tokenizer-0``): setproctitle when installed
    (the whole command line), else the kernel's 15-character thread name."""
    try:
        import setproctitle
    except ImportError:
        try:
            import ctypes

            ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        return
    setproctitle.setproctitle(title)


def stop_on_sigterm() -> threading.Event:
    """An Event set by SIGTERM, for loops that poll with a timeout (main thread only).

    SIGINT is ignored: a Ctrl-C in the terminal reaches every process of the group, and the
    launcher must stop the stages in order (ingress drains first), so only it acts on SIGINT.
    """
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return stop


class ReplySockets:
    """PUSH sockets to ingress reply addresses, made on first use and kept. An address that is
    not an ingress's of this deployment is refused (counted in ``refused``), so a forged request
    cannot make a stage connect out to a place of its choosing."""

    def __init__(self, ctx: zmq.Context, addresses: Addresses, max_sockets: int = 256):
        self._ctx = ctx
        self._addresses = addresses
        self._socks: dict[str, zmq.Socket] = {}
        self._codec = Codec(IngressIn)
        self._max = max_sockets
        self.refused = 0

    def send(self, address: str, msg: msgspec.Struct) -> None:
        """Deliver ``msg`` to the ingress at ``address``; drops it if that ingress is gone."""
        sock = self._socks.get(address)
        if sock is None:
            if not self._addresses.is_reply_address(address):
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th, ...: a flood logs little
                    logger.warning("refused to answer to %r, not an ingress of this deployment (%d so far)",
                                   address[:200], self.refused)
                return
            if len(self._socks) >= self._max:  # ingresses come and go; forget the oldest
                old = next(iter(self._socks))
                self._socks.pop(old).close(linger=0)
            sock = open_socket(self._ctx, zmq.PUSH, connect=address, send_hwm=100_000, curve=self._addresses.curve)
            self._socks[address] = sock
        try:
            self._codec.send(sock, msg, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("ingress %s is not reading; dropped a %s", address, type(msg).__name__)

    def close(self) -> None:
        """Close every socket."""
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()

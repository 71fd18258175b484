"""Tensor parallel, rank 0's side and the other ranks' process: start them, send each step's
plan, watch them.

Rank 0 is the engine (it schedules and samples); ranks 1..tp-1 are processes this module starts
(``multiprocessing`` spawn), each owning one device (``cuda:<rank>`` of the visible ones, or the
CPU) and a runner over its shard of the model. Per step rank 0 sends each rank one
``StepPlan`` (msgpack over a ZeroMQ ipc socket: ~tens of µs, never pickle) and then runs the same
plan itself; the ranks meet in the step's collectives (``engine/distributed.py``).

Failure. Every rank sends a heartbeat each ``HEARTBEAT_S`` from a thread of its own, so a rank
that is alive but busy keeps beating. Rank 0's watchdog thread calls it failed when its process
exits, when it reports an error, or when its beats stop for ``EngineConfig.tp_hang_timeout``
seconds (a frozen process). It then kills every rank and aborts rank 0's NCCL communicators (a collective that
waits on a dead peer never returns: with the peers gone, gloo's raises; NCCL's returns once
aborted) and calls ``on_failure``: the engine process exits there, so the launcher fails the
requests in flight and restarts the stage; in-process (the pipeline) the next step raises. A
rank whose parent (rank 0) dies exits by itself: no process outlives the engine.

Stopping. ``stop`` sends every rank a STOP plan, on which it leaves the process group and exits;
rank 0 leaves the group at the same time (``LLMEngine.close``); ``close`` then waits for the
processes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from ..protocol.addresses import free_port
from ..protocol.codec import Codec
from ..protocol.errors import EngineConfigError
from ..protocol.tp import HEARTBEAT_S, RankIn, RankOut, RankStatus, StepKind, StepPlan
from .config import EngineConfig
from .distributed import abort_tp
from .tp_socket_dir import TPSocketDir

if TYPE_CHECKING:
    from .model_runner import ModelRunner
    from .rank_timing import RankTiming

logger = logging.getLogger(__name__)

_KIND_NAMES = {StepKind.GRAPH: "graph", StepKind.FORWARD: "eager", StepKind.SCORE: "score"}
READY_TIMEOUT_S = 1800.0  # loading a large checkpoint and capturing graphs takes minutes
ABORT_WAIT_S = 5.0  # how long a failure waits for NCCL's abort before going on without it


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, froze or failed; the engine cannot go on."""


class TPWorkers:
    """Ranks 1..tp-1 of one engine: started at construction; ``close()`` stops them all."""

    def __init__(self, model_path: str | Path, config: EngineConfig, on_failure: Callable[[str], None] | None = None,
                 log_level: str | None = None) -> None:
        self.size = config.tp
        self.failure: str | None = None
        self.on_failure = on_failure
        self.hang_timeout = float(config.tp_hang_timeout)  # a rank silent this long is frozen
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self._socket_dir = TPSocketDir()  # removed however this process ends (tp_socket_dir.py)
        self._dir = str(self._socket_dir.path)
        self._ctx = zmq.Context()
        self._codec = Codec(RankIn)
        self._status = self._ctx.socket(zmq.PULL)
        self._status.bind(f"ipc://{self._dir}/status")
        self._plans: list[zmq.Socket] = []
        self.procs: list[mp.Process] = []
        self._ready: set[int] = set()
        self._joining: set[int] = set()  # ranks about to join the process group
        self._beats: dict[int, float] = {}  # last heartbeat per rank (none yet: still importing)
        self._closing = False
        self._failing = False
        self._stopping = False
        self._abort: threading.Thread | None = None  # aborting NCCL after a failure (_fail)
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        spawn = mp.get_context("spawn")
        for rank in range(1, self.size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # plans are never dropped; a dead rank is the watchdog's
            address = f"ipc://{self._dir}/plan-{rank}"
            sock.bind(address)
            self._plans.append(sock)
            proc = spawn.Process(target=run_tp_rank, name=f"conveyor-tp-rank-{rank}", daemon=True,
                                 args=(rank, self.size, self.init_method, address, f"ipc://{self._dir}/status",
                                       str(model_path), config, level))
            with _main_module_hidden():
                proc.start()
            self.procs.append(proc)
            logger.info("started tensor-parallel rank %d (pid %d)", rank, proc.pid)
        self._watch_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # ---- the hot path ----------------------------------------------------------------------------
    def send(self, plan: StepPlan) -> None:
        """Hand one step's plan to every other rank (encoded once)."""
        self._raise_if_failed()
        frame = self._codec.encode(plan)
        for sock in self._plans:
            # A PUSH socket whose peer has gone blocks in send: retry in steps that see the failure.
            while not _sent(sock, frame):
                self._raise_if_failed()
                time.sleep(0.001)

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` (the query of a device event rank 0 would otherwise synchronize
        on), raising ``TPWorkerError`` once a rank has failed: a step whose collective waits on a
        dead peer may never end, and a blocking synchronize would wait with it."""
        while not done():
            self._raise_if_failed()
            time.sleep(0)  # lets the watchdog thread run

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TPWorkerError(f"tensor parallel stopped: {self.failure}")

    # ---- watching ---------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every rank has built its model and cache (raises if one fails first)."""
        self._wait_for(self._ready, "ready", timeout)

    def wait_joining(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every rank is about to join the process group (raises if one fails
        first). Rank 0 joins only then: torch's rendezvous waits for every rank inside C++ for
        the whole collective timeout, where a rank that died while importing would leave it."""
        self._wait_for(self._joining, "joining the process group", timeout)

    def _wait_for(self, ranks: set[int], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(ranks) < self.size - 1:
            if self.failure is not None:
                raise TPWorkerError(f"tensor parallel failed while starting: {self.failure}")
            if time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel ranks not {what} after {timeout:.0f}s")
            time.sleep(0.02)

    def _watch(self) -> None:
        codec = Codec(RankOut)
        while not self._watch_stop.wait(0.1):
            while self._status.poll(0):
                try:
                    msg = codec.recv(self._status)
                except Exception:  # noqa: BLE001 - a garbled frame is no news
                    continue
                self._beats[msg.rank] = time.monotonic()
                if msg.state == "joining":
                    self._joining.add(msg.rank)
                elif msg.state == "ready":
                    self._ready.add(msg.rank)
                    logger.info("tensor-parallel rank %d ready (pid %d)", msg.rank, msg.pid)
                elif msg.state == "failed":
                    self._fail(f"rank {msg.rank} failed: {msg.error}")
            if self._stopping or self._failing:
                continue  # once told to stop, ranks exit by design
            now = time.monotonic()
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                    break
                # Silence counts only after a first beat: starting (imports, CUDA) takes seconds.
                last = self._beats.get(rank)
                if last is not None and now - last > self.hang_timeout:
                    self._fail(f"rank {rank} (pid {proc.pid}) sent no heartbeat for {now - last:.0f}s")
                    break

    def _fail(self, why: str) -> None:
        if self._failing or self._stopping:
            return
        self._failing = True
        logger.error("tensor parallel: %s; stopping every rank", why)
        self._kill_all()
        self._socket_dir.remove()  # no rank is left to connect; on_failure may leave by os._exit
        # Under NCCL, a collective rank 0 waits in would otherwise wait for the dead. The abort
        # runs in a thread of its own, waited for a while only: with decode graphs alive, NCCL's
        # teardown does not return until they are freed (LLMEngine.close frees them, then waits
        # here, ``wait_aborted``), and on_failure must run all the same.
        abort = threading.Thread(target=abort_tp, name="tp-abort", daemon=True)
        abort.start()
        self._abort = abort
        # Set once every rank is gone and the abort under way: whoever reads it finds no rank
        # left, and an abort to wait for rather than one to start.
        self.failure = why
        abort.join(ABORT_WAIT_S)
        if self.on_failure is not None:
            self.on_failure(why)

    def wait_aborted(self, timeout: float = ABORT_WAIT_S) -> bool:
        """After a failure, wait for rank 0's communicators' abort; False if it has not ended."""
        if self._abort is None:
            return True
        self._abort.join(timeout)
        return not self._abort.is_alive()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)

    # ---- stopping ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell every rank to stop: each leaves the process group and exits."""
        if not self._stopping:
            self._stopping = True  # from here the watchdog takes an exiting rank for a stopping one
            if self.failure is None:
                stop = self._codec.encode(StepPlan(StepKind.STOP))
                for sock in self._plans:
                    sock.send(stop, copy=False)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (``stop`` if not done), wait for them (killing what is left), release
        the sockets."""
        if self._closing:
            return
        self.stop()
        self._closing = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
        self._kill_all()
        self._watch_stop.set()
        self._watchdog.join(1)
        for sock in [*self._plans, self._status]:
            sock.close(linger=0)
        self._ctx.term()
        self._socket_dir.remove()


def _sent(sock: zmq.Socket, frame) -> bool:
    """Send ``frame`` without blocking; False when the socket cannot take it now."""
    try:
        sock.send(frame, zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a rank starts, the parent's ``__main__`` looks like an interactive one, so that
    ``spawn`` does not run the user's script again in the rank (it needs nothing from it: its
    target and arguments live in this package). A script without the ``if __name__ ==
    "__main__":`` guard would otherwise start a second engine in every rank, which fails."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


# ---- the other ranks' process ----------------------------------------------------------------------

def _heartbeat(ctx: zmq.Context, address: str, rank: int, stop: threading.Event) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    codec = Codec(RankOut)
    beat = RankStatus(rank, "alive", os.getpid())
    try:
        while not stop.wait(HEARTBEAT_S):
            try:
                codec.send(sock, beat, zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close()


def _exit_with_parent() -> None:
    """Exit this process as soon as rank 0's process is gone (even mid-collective)."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
    os._exit(1)


def _follow(runner: ModelRunner, plans: zmq.Socket, codec: Codec) -> None:
    """Run rank 0's plans until its STOP."""
    prev_ids = None
    while (plan := codec.recv(plans)).kind != StepKind.STOP:
        prev_ids = runner.follow(plan, prev_ids)


def _follow_timed(runner: ModelRunner, plans: zmq.Socket, codec: Codec, timing: RankTiming) -> None:
    """``_follow``, logging each step's wait for its plan, host time and GPU span in ``timing``
    (a ``RankTiming``: ``EngineConfig.rank_timing_dir``, benchmarks only)."""
    prev_ids = None
    while True:
        t_wait = time.perf_counter()
        plan = codec.recv(plans)
        if plan.kind == StepKind.STOP:
            return
        t_host = time.perf_counter()
        timing.begin()
        prev_ids = runner.follow(plan, prev_ids)
        timing.end(_KIND_NAMES.get(plan.kind, str(plan.kind)), len(plan.input_ids), t_host - t_wait,
                   time.perf_counter() - t_host)


def run_tp_rank(rank: int, size: int, init_method: str, plan_address: str, status_address: str,
                model_path: str, config: EngineConfig, log_level: str = "INFO") -> None:
    """Entry point of tensor-parallel rank ``rank`` (1..size-1): build the shard, then follow plans."""
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(process)d rank{rank} %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 decides
    threading.Thread(target=_exit_with_parent, name="tp-parent", daemon=True).start()
    ctx = zmq.Context()
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(ctx, status_address, rank, stop), name="tp-heartbeat",
                     daemon=True).start()
    status = ctx.socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 2000)
    status.connect(status_address)
    plans = ctx.socket(zmq.PULL)
    plans.connect(plan_address)
    out_codec, in_codec = Codec(RankOut), Codec(RankIn)
    code = 0
    try:
        from ..kernels import set_kernel_mode
        from .distributed import close_tp, init_tp
        from .engine_inputs import resolve_engine_inputs
        from .model_runner import ModelRunner

        set_kernel_mode(config.kernels)
        path, model_config, device, dtype = resolve_engine_inputs(model_path, config, rank)
        out_codec.send(status, RankStatus(rank, "joining", os.getpid()))
        init_tp(rank, size, init_method, device, config.tp_all_reduce)
        runner = ModelRunner(path, model_config, config, device, dtype)
        out_codec.send(status, RankStatus(rank, "ready", os.getpid()))
        if config.rank_timing_dir is None:
            _follow(runner, plans, in_codec)
            runner.release_graphs()  # before NCCL's teardown (ModelRunner.release_graphs)
            close_tp()  # with rank 0, which is leaving the group now
        else:
            from .rank_timing import RankTiming

            timing = RankTiming(rank, Path(config.rank_timing_dir), device)
            _follow_timed(runner, plans, in_codec, timing)
            runner.release_graphs()
            close_tp()
            timing.write()
    except Exception as exc:  # report to rank 0, then exit
        logger.exception("tensor-parallel rank %d failed", rank)
        error = f"{type(exc).__name__}: {exc}" if isinstance(exc, EngineConfigError) else traceback.format_exc(limit=3)
        out_codec.send(status, RankStatus(rank, "failed", os.getpid(), error))
        code = 1
    finally:
        stop.set()
        status.close()
        plans.close(linger=0)
    os._exit(code)  # skip interpreter teardown (CUDA/NCCL objects at exit can hang)

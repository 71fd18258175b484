"""The engine stage: drives an Engine (``engine/interface.py``) from its input socket and sends
one TokenBatch out per step.

Two IO threads keep the sockets moving while a step runs (vLLM's EngineCoreProc pattern): the
input thread decodes messages and answers Pings from the last stats snapshot; the output thread
encodes and sends. The engine loop only moves messages through queues, dispatching on their
type, and blocks when it has nothing to do. Requests are idempotent by id: a TokenizedReq the
ingress resent (its first copy was slow, not lost) is admitted once.

LoRA adapters load and unload on the engine thread between two steps (LoadAdapter reads a
checkpoint: a step may wait a second for it); the answer, AdapterDone or ErrorOut, goes to the
ingress at ``reply_to`` through the detokenizer, as Admitted does.

No request outlives the ingress waiting for it: an ingress Pings the engine every half second
(its heartbeat); the requests of an ingress not heard from for ``orphan_after_s`` are aborted,
and at once when the launcher says that ingress died (IngressGone).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from ...engine.interface import Engine, Output
from ...protocol import (
    Abort,
    AdapterDone,
    Addresses,
    Admitted,
    CancelSession,
    Codec,
    ConveyorError,
    DetokenizerIn,
    EngineIn,
    EngineStats,
    ErrorOut,
    IngressGone,
    LoadAdapter,
    LoadReport,
    Ping,
    SessionEnd,
    Stage,
    StopReq,
    TokenBatch,
    TokenizedReq,
    UnknownAdapterError,
    UnloadAdapter,
    error_code,
)
from ..stage import announce_ready, internal_error, open_socket

logger = logging.getLogger(__name__)

_RECENT_RIDS = 100_000  # request ids remembered, so that a resent duplicate is not run twice
PROMPT_TAIL = 8  # prompt tokens the detokenizer needs to render the first output token right
RELEASE_IDLE_EVERY_S = 1.0  # how often idle sessions' KV blocks are looked at (the timeout is minutes)
# An ingress silent this long is gone (it Pings every 0.5 s; its own verdict on a silent engine
# takes 10 s): the requests it sent are aborted.
ORPHAN_AFTER_S = 10.0


class EngineCall:
    """Run ``fn(engine)`` on the engine thread (in-process only: never crosses a socket)."""

    def __init__(self, fn: Callable[[Engine], Any]):
        self.fn = fn
        self.future: Future = Future()


class EngineService:
    """Moves messages between the sockets and an Engine."""

    def __init__(self, engine: Engine, ctx: zmq.Context, addresses: Addresses, orphan_after_s: float = ORPHAN_AFTER_S):
        self.engine = engine
        self._ctx, self._addresses = ctx, addresses
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._seen: OrderedDict[str, None] = OrderedDict()  # request ids admitted (live or recently done)
        self._snapshot = EngineStats()
        self._in_codec = Codec(EngineIn)
        self.draining = False
        self._busy, self._steps = 0.0, 0  # seconds spent stepping and batching, and steps
        # Requests that reached the input thread, and those the engine thread has taken: their
        # difference, reported on Pings, tells clients that an unadmitted request is waiting
        # behind a long step (a kernel compiling on first use), not lost (engine_client.py).
        self._arrived, self._taken = 0, 0
        self._drained_at = time.monotonic()  # when the engine thread last took its input
        self._next_release = 0.0  # perf_counter() time of the next release_idle_sessions()
        self.orphan_after_s = orphan_after_s
        self._heard: dict[str, float] = {}  # ingress reply address -> monotonic() of its last Ping
        self._owners: dict[str, str] = {}  # running request id -> the reply address of its ingress
        self.orphans_aborted = 0

    # ---- IO threads ----------------------------------------------------------------------------
    def _input_loop(self, stop: threading.Event, bound: threading.Event) -> None:
        sock = open_socket(self._ctx, zmq.PULL, bind=self._addresses.engine_in.bind, curve=self._addresses.curve)
        bound.set()
        codec = self._in_codec
        try:
            while not stop.is_set():
                try:
                    if not sock.poll(200):
                        continue
                except zmq.ContextTerminated:  # the owner is shutting down: nothing more to read
                    return
                for msg in codec.recv_all(sock):
                    if isinstance(msg, Ping):  # answered here, even while a long step runs
                        if self._addresses.is_reply_address(msg.reply_to):  # the ingress's heartbeat
                            self._heard[msg.reply_to] = time.monotonic()
                        backlog = self._arrived - self._taken
                        stats = {**msg.stage_stats, "engine_busy_s": self._busy, "engine_steps": self._steps,
                                 "engine_bad_frames": codec.dropped, "engine_backlog": backlog,
                                 # how long the waiting requests have waited for the step loop at most
                                 "engine_backlog_age_s": time.monotonic() - self._drained_at if backlog else 0.0,
                                 "engine_orphans_aborted": self.orphans_aborted}
                        self._outbox.put(LoadReport(msg.reply_to, msg.sent_at, self._snapshot, self.draining, stats))
                    else:
                        self._arrived += isinstance(msg, TokenizedReq)
                        self._inbox.put(msg)
        finally:
            sock.close(linger=0)

    def _output_loop(self) -> None:
        sock = open_socket(self._ctx, zmq.PUSH, connect=self._addresses.detokenizer_in.connect, linger_ms=1000,
                           curve=self._addresses.curve)
        codec = Codec(DetokenizerIn)
        try:
            while (msg := self._outbox.get()) is not None:
                try:
                    codec.send(sock, msg)
                except zmq.ContextTerminated:  # the owner is shutting down: nobody reads any more
                    return
        finally:
            sock.close()

    # ---- engine loop ---------------------------------------------------------------------------
    def serve(self, stop: threading.Event, launcher: str | None = None, info: dict | None = None) -> None:
        """Run until ``stop`` is set."""
        self._snapshot = self.engine.stats()  # before the input thread can answer a Ping
        bound = threading.Event()
        threads = [threading.Thread(target=self._input_loop, args=(stop, bound), name="engine-in", daemon=True),
                   threading.Thread(target=self._output_loop, name="engine-out", daemon=True)]
        for t in threads:
            t.start()
        bound.wait()
        announce_ready(self._ctx, launcher, Stage.ENGINE, self._addresses, **(info or {}))
        try:
            while not stop.is_set():
                msgs = self._take_messages(block=not self.engine.has_work)
                self._drained_at = time.monotonic()
                start = time.perf_counter()
                self.handle(msgs)
                if self.engine.has_work:
                    outputs = self.engine.step()
                    if outputs:
                        self._outbox.put(to_token_batch(outputs))
                        self._steps += 1
                        for o in outputs:
                            if o.finish_reason is not None:
                                self._owners.pop(o.request_id, None)
                if start >= self._next_release:  # also while idle: the loop wakes every 0.2 s
                    self.engine.release_idle_sessions()
                    self.abort_orphans()
                    self._next_release = start + RELEASE_IDLE_EVERY_S
                self._snapshot = self.engine.stats()
                self._busy += time.perf_counter() - start
        finally:
            self._outbox.put(None)
            # Both IO threads must be off their sockets before the owner terminates the context
            # (the input thread notices ``stop`` within one 200 ms poll).
            for t in threads:
                t.join(timeout=2)
            for msg in self._take_messages(block=False):  # nobody will run these now
                if isinstance(msg, EngineCall):
                    msg.future.set_exception(RuntimeError("the engine stopped"))

    def _take_messages(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            return msgs

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` between two steps and return its result (from another thread)."""
        call = EngineCall(fn)
        self._inbox.put(call)
        return call.future.result()

    def handle(self, msgs: list) -> None:
        """Apply input messages to the engine, on the engine thread, by type. A message that
        raises is logged and dropped: no message may stop the engine (requests are checked in
        ``_add``; the others only name ids, which the engine looks up)."""
        for msg in msgs:
            try:
                self._apply(msg)
            except Exception:  # one message must not take every request down with the engine
                logger.exception("dropped a %s that could not be applied", type(msg).__name__)

    def _apply(self, msg: Any) -> None:
        """Apply one input message, by type."""
        if isinstance(msg, TokenizedReq):
            self._add(msg)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.rid)
        elif isinstance(msg, StopReq):
            self.engine.stop(msg.rid)
        elif isinstance(msg, CancelSession):
            self.engine.abort_session(msg.session_id)
        elif isinstance(msg, SessionEnd):
            self.engine.end_session(msg.session_id)
        elif isinstance(msg, IngressGone):
            if self._addresses.is_launcher_token(msg.token):
                self._abort_requests_of(msg.reply_to, "its ingress died")
                self._heard.pop(msg.reply_to, None)
            else:
                logger.warning("ignored an IngressGone without the launcher's token")
        elif isinstance(msg, LoadAdapter | UnloadAdapter):
            self._adapter_op(msg)
        elif isinstance(msg, EngineCall):
            try:
                msg.future.set_result(msg.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets its own error
                msg.future.set_exception(exc)

    def abort_orphans(self, now: float | None = None) -> None:
        """Abort the requests of every ingress silent for ``orphan_after_s`` (only of one that has
        Pinged: a client that never does, such as a test driving this service directly, is not
        judged). A silent ingress stays listed, so a request of it that arrives late is aborted
        too; one silent for a hundred times longer is forgotten."""
        now = time.monotonic() if now is None else now
        for address, heard in list(self._heard.items()):
            silent = now - heard
            if silent > 100 * self.orphan_after_s:
                self._heard.pop(address, None)
            elif silent > self.orphan_after_s:
                self._abort_requests_of(address, f"its ingress has been silent for {silent:.0f}s")

    def _abort_requests_of(self, address: str, why: str) -> None:
        rids = [rid for rid, owner in self._owners.items() if owner == address]
        for rid in rids:
            del self._owners[rid]
            self.engine.abort(rid)
        if rids:
            self.orphans_aborted += len(rids)
            logger.warning("aborted %d request(s) of %s: %s", len(rids), address, why)

    def _add(self, msg: TokenizedReq) -> None:
        """Admit a request (Admitted goes out before any of its tokens) or refuse it (ErrorOut)."""
        self._taken += 1
        if msg.rid in self._seen:
            return  # a resend of a request already admitted or refused
        self._seen[msg.rid] = None
        while len(self._seen) > _RECENT_RIDS:
            self._seen.popitem(last=False)
        try:
            req = self.engine.add_request(msg.token_ids, msg.params, msg.rid, msg.session_id, msg.first_turn_ids,
                                          priority=msg.priority, images=msg.images)
        except ConveyorError as exc:
            self._outbox.put(refusal(msg.rid, msg.reply_to, exc))
            return
        except Exception:  # one bad request must not stop the engine; details stay in the log
            logger.exception("adding request %s failed", msg.rid)
            err = internal_error(msg.rid, "engine")
            err.reply_to = msg.reply_to
            self._outbox.put(err)
            return
        self._owners[msg.rid] = msg.reply_to
        ids = req.turn_token_ids
        self._outbox.put(Admitted(msg.rid, msg.reply_to, len(ids), msg.params.detokenize_params(),
                                  ids[-PROMPT_TAIL:], req.num_history_tokens))


    def _adapter_op(self, msg: LoadAdapter | UnloadAdapter) -> None:
        """Load or unload a LoRA adapter; answer AdapterDone (the whole list after the change) or ErrorOut."""
        try:
            if isinstance(msg, LoadAdapter):
                self.engine.load_adapter(msg.name, msg.path)
            else:
                self.engine.unload_adapter(msg.name)
        except ConveyorError as exc:
            self._outbox.put(refusal(msg.rid, msg.reply_to, exc))
            return
        except Exception:  # a checkpoint that breaks the loader must not stop the engine
            logger.exception("%s of LoRA adapter %r failed", type(msg).__name__, msg.name)
            err = internal_error(msg.rid, "engine")
            err.reply_to = msg.reply_to
            self._outbox.put(err)
            return
        # Pings answered from now on list the change (an ingress told by AdapterDone must not be
        # told otherwise by a later LoadReport).
        self._snapshot = self.engine.stats()
        self._outbox.put(AdapterDone(msg.rid, msg.reply_to, self.engine.adapter_names()))
        logger.info("LoRA adapter %r %s", msg.name, "loaded" if isinstance(msg, LoadAdapter) else "unloaded")


def refusal(rid: str, reply_to: str, exc: ConveyorError) -> ErrorOut:
    """The ErrorOut of a refused message: 404 for a LoRA adapter not loaded (OpenAI's model_not_found), else 400."""
    status = 404 if isinstance(exc, UnknownAdapterError) else 400
    return ErrorOut(rid, status, str(exc), param=getattr(exc, "param", None), code=error_code(exc), reply_to=reply_to)


def to_token_batch(outputs: list[Output]) -> TokenBatch:
    """One step's outputs, column-wise."""
    want_lp = any(o.logprob is not None for o in outputs)
    return TokenBatch(
        rids=[o.request_id for o in outputs],
        tokens=[-1 if o.token is None else o.token for o in outputs],
        finish=[-1 if o.finish_reason is None else int(o.finish_reason) for o in outputs],
        cached=[o.num_cached_tokens for o in outputs],
        logprobs=[o.logprob or 0.0 for o in outputs] if want_lp else None,
        top_logprobs=[o.top_logprobs or [] for o in outputs] if want_lp else None,
    )

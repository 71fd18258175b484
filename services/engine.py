"""The engine stage: wraps LLMEngine; one input socket, one TokenBatch out per step.

Two IO threads keep the sockets moving while a step runs (vLLM's EngineCoreProc pattern): the
input thread decodes messages, answers Pings from the last load snapshot and announces new
requests at once; the output thread encodes and sends. The engine loop itself only moves
Python objects through queues and blocks when it has nothing to do.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import msgspec
import zmq

from conveyor.engine.config import EngineConfig
from conveyor.engine.errors import ConveyorError, error_code
from conveyor.engine.fake_engine import FakeEngine
from conveyor.engine.llm_engine import LLMEngine, StepOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.protocol import (
    Abort,
    Addresses,
    Codec,
    DetokenizerIn,
    EngineIn,
    ErrorOut,
    LoadReport,
    NewRequest,
    Ping,
    SessionEnd,
    Stage,
    StopReq,
    TokenBatch,
    TokenizedReq,
)
from conveyor.services.stage import announce_ready, setup_logging, stop_on_sigterm

logger = logging.getLogger(__name__)

_RECENT_RIDS = 100_000  # finished request ids remembered, so a resent duplicate is not run twice


class EngineCall:
    """Run ``fn(engine)`` on the engine thread (in-process only: never crosses a socket)."""

    def __init__(self, fn):
        self.fn = fn
        self.future: Future = Future()


class EngineService:
    """Moves messages between the sockets and an LLMEngine."""

    def __init__(self, engine: LLMEngine, ctx: zmq.Context, addresses: Addresses):
        self.engine = engine
        self._ctx, self._addresses = ctx, addresses
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._rid_to_seq: dict[str, int] = {}
        self._seq_to_rid: dict[int, str] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # rids admitted (live or recently done)
        self._seen_lock = threading.Lock()
        self._next_seq = 0
        self._early_aborts: OrderedDict[str, None] = OrderedDict()  # aborts that overtook their request
        self._snapshot: dict = {}
        self.draining = False
        self._busy, self._steps = 0.0, 0  # seconds spent stepping and batching, and steps

    # ---- IO threads ----------------------------------------------------------------------------
    def _input_loop(self, stop: threading.Event) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._addresses.engine_in.bind)
        self._bound.set()
        codec = Codec(EngineIn)
        try:
            while not stop.is_set():
                try:
                    if not sock.poll(200):
                        continue
                except zmq.ContextTerminated:  # the owner is shutting down: nothing more to read
                    return
                for msg in self._recv_all(sock, codec):
                    if isinstance(msg, Ping):
                        stats = {**msg.stage_stats, "engine_busy_s": self._busy, "engine_steps": self._steps}
                        self._outbox.put(LoadReport(msg.reply_to, msg.sent_at, draining=self.draining,
                                                    stage_stats=stats, **self._snapshot))
                        continue
                    if isinstance(msg, TokenizedReq):
                        with self._seen_lock:
                            if msg.rid in self._seen:
                                continue  # a resend of a request already admitted
                            self._seen[msg.rid] = None
                            while len(self._seen) > _RECENT_RIDS:
                                self._seen.popitem(last=False)
                        # Announce at once: the ingress learns the request arrived even while a
                        # long step runs, and the detokenizer sees it before any of its tokens.
                        self._outbox.put(TokenBatch([], [], [], [], new=[
                            NewRequest(msg.rid, msg.detok, len(msg.token_ids))]))
                    self._inbox.put(msg)
        finally:
            sock.close(linger=0)

    @staticmethod
    def _recv_all(sock: zmq.Socket, codec: Codec) -> list:
        out = []
        while True:
            try:
                out.append(codec.recv(sock, zmq.NOBLOCK))
            except zmq.Again:
                return out
            except Exception:  # noqa: BLE001 - drop a malformed frame, keep the rest
                logger.exception("undecodable frame on the engine input")

    def _output_loop(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self._addresses.detokenizer_in.connect)
        codec = Codec(DetokenizerIn)
        try:
            while True:
                msg = self._outbox.get()
                if msg is None:
                    return
                codec.send(sock, msg)
        finally:
            sock.close()

    # ---- engine loop ---------------------------------------------------------------------------
    def serve(self, stop: threading.Event, launcher: str | None = None, info: dict | None = None) -> None:
        """Run until ``stop`` is set."""
        self._bound = threading.Event()
        threads = [threading.Thread(target=self._input_loop, args=(stop,), name="engine-in", daemon=True),
                   threading.Thread(target=self._output_loop, name="engine-out", daemon=True)]
        for t in threads:
            t.start()
        self._bound.wait()
        self._update_snapshot()
        announce_ready(self._ctx, launcher, Stage.ENGINE, **(info or {}))
        try:
            while not stop.is_set():
                msgs = self._take_messages(block=not self.engine.has_work)
                start = time.perf_counter()
                errors = self.handle(msgs)
                outputs = self.engine.step() if self.engine.has_work else []
                if outputs or errors:
                    self._outbox.put(self._to_batch(outputs, errors))
                    self._steps += 1
                self._update_snapshot()
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

    def call(self, fn):
        """Run ``fn(engine)`` between two steps and return its result (from another thread)."""
        call = EngineCall(fn)
        self._inbox.put(call)
        return call.future.result()

    def handle(self, msgs: list) -> list[ErrorOut]:
        """Apply input messages to the engine (on the engine thread); returns refusals."""
        errors = []
        for msg in msgs:
            if isinstance(msg, EngineCall):
                try:
                    msg.future.set_result(msg.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller gets its own error
                    msg.future.set_exception(exc)
            elif isinstance(msg, TokenizedReq):
                err = self._add(msg)
                if err is not None:
                    errors.append(err)
            elif isinstance(msg, (Abort, StopReq)):
                seq_id = self._rid_to_seq.get(msg.rid)
                if seq_id is not None:
                    (self.engine.abort if isinstance(msg, Abort) else self.engine.stop)(seq_id)
                elif isinstance(msg, Abort):
                    # The abort went straight to us while its request was still at a tokenizer.
                    self._early_aborts[msg.rid] = None
                    while len(self._early_aborts) > 10_000:
                        self._early_aborts.popitem(last=False)
            elif isinstance(msg, SessionEnd):
                self.engine.end_session(msg.session_id)
        return errors

    def _add(self, msg: TokenizedReq) -> ErrorOut | None:
        params = SamplingParams(**msgspec.structs.asdict(msg.params))  # same fields as the wire form
        seq_id = self._next_seq
        self._next_seq += 1
        try:
            self.engine.add_request(msg.token_ids, params, seq_id=seq_id, session_id=msg.session_id)
        except ConveyorError as exc:
            return ErrorOut(msg.rid, 400, str(exc), param=getattr(exc, "param", None), code=error_code(exc),
                            reply_to=msg.detok.reply_to)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine
            logger.exception("adding request %s failed", msg.rid)
            return ErrorOut(msg.rid, 500, f"engine error: {exc}", type="internal_error", reply_to=msg.detok.reply_to)
        self._rid_to_seq[msg.rid] = seq_id
        self._seq_to_rid[seq_id] = msg.rid
        if msg.rid in self._early_aborts:
            del self._early_aborts[msg.rid]
            self.engine.abort(seq_id)  # reported as finished (abort) by the next step
        return None

    def _to_batch(self, outputs: list[StepOutput], errors: list[ErrorOut]) -> TokenBatch:
        rids, tokens, finish, cached = [], [], [], []
        want_lp = any(o.logprobs for o in outputs)
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for o in outputs:
            rid = self._seq_to_rid.get(o.seq_id)
            if rid is None:
                continue
            rids.append(rid)
            tokens.append(o.token_ids[0] if o.token_ids else -1)
            finish.append(int(o.finish_reason) if o.finished else -1)
            cached.append(o.num_cached_tokens)
            if want_lp:
                lps.append(o.logprobs[0] if o.logprobs else 0.0)
                tops.append(o.top_logprobs[0] if o.top_logprobs else [])
            if o.finished:
                del self._seq_to_rid[o.seq_id]
                self._rid_to_seq.pop(rid, None)
        return TokenBatch(rids, tokens, finish, cached, logprobs=lps if want_lp else None,
                          top_logprobs=tops if want_lp else None, errors=errors)

    def _update_snapshot(self) -> None:
        s = self.engine.stats()
        bm = self.engine.block_manager
        self._snapshot = {
            "running": int(s["running"]), "waiting": int(s["waiting"]), "kv_usage": float(s["kv_usage"]),
            "num_blocks": bm.num_blocks, "free_blocks": bm.num_free_blocks,
            "prefix_hit_tokens": int(s["prefix_hit_tokens"]), "prefix_query_tokens": int(s["prefix_query_tokens"]),
            "generated_tokens": int(s.get("generated_tokens", 0)),
        }


def _fake_engine(model_path: str, config: EngineConfig) -> FakeEngine:
    from conveyor.services.tokenize import load_tokenizer

    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    ids = load_tokenizer(model_path).encode(text * 4, add_special_tokens=False)
    # CONVEYOR_FAKE_STEP_DELAY (seconds) slows it down, for tests that need requests in flight.
    delay = float(os.environ.get("CONVEYOR_FAKE_STEP_DELAY", "0"))
    return FakeEngine(ids, session_len=config.session_len or 8192, max_batch_size=config.max_batch_size,
                      step_delay=delay)


def run_engine_process(addresses: Addresses, model_path: str, config: EngineConfig, launcher: str | None,
                       log_level: str = "INFO", fake: bool = False) -> None:
    """Entry point of the engine process (``fake``: no model, tokens as fast as possible)."""
    setup_logging(log_level)
    stop = stop_on_sigterm()
    engine = _fake_engine(model_path, config) if fake else LLMEngine(model_path, config)
    info = {"session_len": engine.session_len, "num_blocks": engine.block_manager.num_blocks,
            "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", "")}
    EngineService(engine, zmq.Context(), addresses).serve(stop, launcher, info)

"""The service stages as threads of the user's process, over ``inproc://``: the pipeline's engine.

The same tokenizer, engine and detokenizer stage code as ``conveyor serve api_server``, with this
object in the ingress's place: it pushes GenerateReq into the ring and routes the TextBatches
addressed to it to one queue per request.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass

import zmq

from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol import (
    Abort,
    Addresses,
    Codec,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressIn,
    LoadReport,
    SessionEnd,
    TextBatch,
    TokenizerIn,
)
from conveyor.services.detokenizer import Detokenizer, serve_detokenizer
from conveyor.services.engine import EngineService
from conveyor.services.tokenize import Preprocessor
from conveyor.services.tokenizer import TokenizerWorker, serve_tokenizer

logger = logging.getLogger(__name__)


class EngineDiedError(RuntimeError):
    """A stage thread stopped on an internal error; the pipeline must be recreated."""


@dataclass
class Delta:
    """New output of one request since the last delta (or its error)."""

    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: ErrorOut | None = None


class LocalStack:
    """Tokenizer, engine and detokenizer threads joined by inproc sockets."""

    def __init__(self, engine: LLMEngine, preprocessor: Preprocessor, session_len: int):
        self.ctx = zmq.Context()
        self.addresses = Addresses.inproc()
        self.reply_to = self.addresses.reply_endpoint().connect
        self._stop = threading.Event()
        self._lock = threading.Lock()  # zmq sockets are not thread-safe; callers may be many threads
        self._queues: dict[str, tuple[queue.Queue, int]] = {}  # rid -> (sink, tag)
        self._ids = itertools.count()
        self.last_load: LoadReport | None = None
        self.error: BaseException | None = None
        # This end's sockets are bound before any stage connects to them.
        self._feed = self.ctx.socket(zmq.PUSH)
        self._feed.bind(self.addresses.tokenizer_in.bind)
        self._results = self.ctx.socket(zmq.PULL)
        self._results.bind(self.reply_to)
        self._feed_codec, self._in_codec = Codec(TokenizerIn), Codec(IngressIn)
        self.engine_service = EngineService(engine, self.ctx, self.addresses)
        stages = {
            "engine": lambda: self.engine_service.serve(self._stop),
            "detokenizer": lambda: serve_detokenizer(self.ctx, self.addresses,
                                                     Detokenizer(preprocessor.tokenizer), self._stop),
            "tokenizer": lambda: serve_tokenizer(self.ctx, self.addresses,
                                                 TokenizerWorker(preprocessor, session_len), self._stop),
        }
        self._threads = [threading.Thread(target=self._guard, args=(name, fn), name=f"conveyor-{name}", daemon=True)
                         for name, fn in stages.items()]
        self._threads.append(threading.Thread(target=self._read, name="conveyor-results", daemon=True))
        for t in self._threads:
            t.start()

    def _guard(self, name: str, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("stage %s died", name)
            self.error = exc
            self._fail_all(f"the {name} stage died: {exc!r}")

    # ---- requests ----------------------------------------------------------------------------
    def new_rid(self) -> str:
        """A fresh request id."""
        return f"local-{next(self._ids)}"

    def submit(self, req: GenerateReq, sink: queue.Queue, tag: int) -> None:
        """Send a request; its Deltas arrive on ``sink`` as ``(tag, delta)``."""
        if self.error is not None:
            raise EngineDiedError(f"the engine stopped: {self.error!r}") from self.error
        req.reply_to = self.reply_to
        self._queues[req.rid] = (sink, tag)
        with self._lock:
            self._feed_codec.send(self._feed, req)

    def abort(self, rid: str) -> None:
        """Stop a request in the engine; its blocks are free when this returns."""
        if self._queues.pop(rid, None) is not None and self.error is None:
            # In-process, the engine thread runs it directly: done before we return.
            self.engine_service.call(lambda _: self.engine_service.handle([Abort(rid)]))

    def end_session(self, session_id: int) -> None:
        """Free a session's KV blocks (done when this returns)."""
        if self.error is None:
            self.engine_service.call(lambda _: self.engine_service.handle([SessionEnd(session_id)]))

    def call(self, fn):
        """Run ``fn(engine)`` on the engine thread between steps."""
        if self.error is not None:
            raise EngineDiedError(f"the engine stopped: {self.error!r}") from self.error
        return self.engine_service.call(fn)

    # ---- results -----------------------------------------------------------------------------
    def _read(self) -> None:
        while not self._stop.is_set():
            if not self._results.poll(200):
                continue
            for msg in self._in_codec.recv_all(self._results):
                if isinstance(msg, TextBatch):
                    self._route(msg)
                elif isinstance(msg, ErrorOut):
                    target = self._queues.pop(msg.rid, None)
                    if target is not None:
                        target[0].put((target[1], Delta(error=msg)))
                elif isinstance(msg, LoadReport):
                    self.last_load = msg

    def _route(self, batch: TextBatch) -> None:
        for i, rid in enumerate(batch.rids):
            target = self._queues.get(rid)
            finish = batch.finish[i]
            if target is None or (finish < 0 and not batch.texts[i] and not batch.token_ids[i]):
                continue  # unknown, or only the admission notice
            if finish >= 0:
                del self._queues[rid]
            target[0].put((target[1], Delta(batch.texts[i], list(batch.token_ids[i]), None if finish < 0 else Finish(finish).openai,
                        batch.prompt_tokens[i], batch.completion_tokens[i], batch.cached[i],
                        batch.logprobs[i] if batch.logprobs is not None else None)))

    def _fail_all(self, why: str) -> None:
        for rid in list(self._queues):
            target = self._queues.pop(rid, None)
            if target is not None:
                target[0].put((target[1], Delta(error=ErrorOut(rid, 503, why, type="service_unavailable"))))

    def close(self) -> None:
        """Stop every stage thread and close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._fail_all("the pipeline is closed")
        for s in (self._feed, self._results):
            s.close(linger=0)
        self.ctx.term()

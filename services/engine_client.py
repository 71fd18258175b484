"""The ingress's side of the conveyor: send requests into the stage ring, read results back.

Runs in the ingress's asyncio loop. One PUSH socket feeds the tokenizer workers, one PUSH
reaches the engine directly (aborts, session ends), and one PULL socket at this ingress's own
``reply_to`` address receives every result addressed to it. A reader task routes results to
per-request queues. A Ping sent around the ring every ``ping_interval`` proves every stage is
alive; when none comes back for ``dead_after`` seconds the client is unhealthy and every
waiting request fails with 503 instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from conveyor.protocol import (
    Abort,
    Addresses,
    Codec,
    Endpoint,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressIn,
    LoadReport,
    Ping,
    SessionEnd,
    TextBatch,
    TokenizerIn,
)
from conveyor.protocol.messages import EngineIn

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """New output of one request since the previous one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | None while running
    prompt_tokens: int
    completion_tokens: int  # running total
    cached_tokens: int
    logprobs: list[dict[int, float]] | None = None  # one entry per new token


class RequestError(Exception):
    """A request failed; ``status`` and the fields map onto the OpenAI error envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_wire(cls, err: ErrorOut) -> "RequestError":
        """From the ErrorOut a stage sent."""
        return cls(err.status, err.message, err.type, err.param, err.code)


def _unavailable(why: str) -> RequestError:
    return RequestError(503, why, type="service_unavailable", code="engine_unavailable")


@dataclass
class _Pending:
    req: GenerateReq
    queue: asyncio.Queue
    sent_at: float
    resends: int = 0
    admitted: bool = False


class EngineClient:
    """Async client of the stage ring, used by the HTTP ingress (one per ingress process)."""

    def __init__(self, addresses: Addresses, model_name: str, session_len: int, reply: Endpoint | None = None,
                 ping_interval: float = 0.5, dead_after: float = 10.0, admit_timeout: float = 3.0,
                 max_resends: int = 2, context: zmq.asyncio.Context | None = None):
        self.addresses = addresses
        self.model_name = model_name
        self.session_len = session_len
        self.reply = reply or addresses.reply_endpoint()
        self.reply_to = self.reply.connect
        self.ping_interval, self.dead_after = ping_interval, dead_after
        self.admit_timeout, self.max_resends = admit_timeout, max_resends
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pending: dict[str, _Pending] = {}
        self._to_tokenizer_codec = Codec(TokenizerIn)
        self._to_engine_codec = Codec(EngineIn)
        self._in_codec = Codec(IngressIn)
        self._last_ring = 0.0
        self._started_at = 0.0
        self.load: LoadReport | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- lifetime ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind/connect the sockets and start the reader and health tasks."""
        self._to_tokenizer = self._ctx.socket(zmq.PUSH)
        self._to_tokenizer.setsockopt(zmq.LINGER, 0)
        self._to_tokenizer.bind(self.addresses.tokenizer_in.bind)
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.connect(self.addresses.engine_in.connect)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        self._results.bind(self.reply.bind)
        self._started_at = time.monotonic()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """Stop the tasks and close the sockets; waiting requests get 503."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all("the server is shutting down")
        for s in (self._to_tokenizer, self._to_engine, self._results):
            s.close(linger=0)

    # ---- health ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """True while a Ping went round the whole ring recently."""
        return self._last_ring > 0 and time.monotonic() - self._last_ring < self.dead_after

    @property
    def num_inflight(self) -> int:
        """Requests sent and not finished."""
        return len(self._pending)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        """Send ``req`` and yield its outputs; closing the iterator early aborts the request."""
        if not self.healthy:
            raise _unavailable("the engine is not available (starting, stopped or unreachable); retry later")
        if req.rid in self._pending:
            raise RequestError(400, f"request id {req.rid!r} is already in flight", param="rid")
        req.reply_to = self.reply_to
        pending = _Pending(req, asyncio.Queue(), time.monotonic())
        self._pending[req.rid] = pending
        finished = False
        try:
            await self._send_to_tokenizer(req)
            while True:
                item = await pending.queue.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._pending.pop(req.rid, None)
            if not finished:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        """Tell the engine to stop a request and free its blocks."""
        await self._send_to_engine(Abort(rid))

    async def end_session(self, session_id: int) -> None:
        """Free a session's KV blocks in the engine."""
        await self._send_to_engine(SessionEnd(session_id))

    async def _send_to_tokenizer(self, msg) -> None:
        await self._to_tokenizer.send(self._to_tokenizer_codec.encode(msg))

    async def _send_to_engine(self, msg) -> None:
        try:
            await self._to_engine.send(self._to_engine_codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("engine socket full or unreachable; dropped %s", type(msg).__name__)

    # ---- background tasks ---------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            frame = await self._results.recv(copy=False)
            try:
                msg = self._in_codec.decode(frame.buffer)
            except Exception:  # noqa: BLE001 - a bad frame must not kill the reader
                logger.exception("undecodable frame on the result socket")
                continue
            if isinstance(msg, TextBatch):
                self._route_texts(msg)
            elif isinstance(msg, ErrorOut):
                pending = self._pending.get(msg.rid)
                if pending is not None:
                    pending.queue.put_nowait(RequestError.from_wire(msg))
            elif isinstance(msg, LoadReport):
                self._last_ring = time.monotonic()
                self.load = msg

    def _route_texts(self, batch: TextBatch) -> None:
        for i, rid in enumerate(batch.rids):
            pending = self._pending.get(rid)
            if pending is None:
                continue
            pending.admitted = True
            finish = batch.finish[i]
            if finish < 0 and not batch.texts[i] and not batch.token_ids[i]:
                continue  # the admission notice: nothing to show yet
            pending.queue.put_nowait(RequestOutput(
                text=batch.texts[i],
                token_ids=batch.token_ids[i],
                finish_reason=None if finish < 0 else Finish(finish).openai,
                prompt_tokens=batch.prompt_tokens[i],
                completion_tokens=batch.completion_tokens[i],
                cached_tokens=batch.cached[i],
                logprobs=batch.logprobs[i] if batch.logprobs is not None else None,
            ))

    async def _watch(self) -> None:
        """Ping the ring; resend requests nobody admitted (a tokenizer died); fail all if the ring is down."""
        was_healthy = False
        while True:
            await asyncio.sleep(self.ping_interval)
            try:
                await self._to_tokenizer.send(
                    self._to_tokenizer_codec.encode(Ping(self.reply_to, time.time())), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no tokenizer connected yet
            now = time.monotonic()
            if was_healthy and not self.healthy:
                logger.error("no answer from the stage ring for %.1fs: failing in-flight requests", self.dead_after)
                self._fail_all("the engine stopped answering; retry later")
            was_healthy = self.healthy
            for pending in list(self._pending.values()):
                if pending.admitted or now - pending.sent_at < self.admit_timeout:
                    continue
                if pending.resends >= self.max_resends:
                    self._pending.pop(pending.req.rid, None)
                    pending.queue.put_nowait(_unavailable("no tokenizer worker took the request; retry later"))
                    continue
                pending.resends += 1
                pending.sent_at = now
                logger.warning("request %s not admitted after %.1fs; resending", pending.req.rid, self.admit_timeout)
                await self._send_to_tokenizer(pending.req)

    def _fail_all(self, why: str) -> None:
        for rid, pending in list(self._pending.items()):
            pending.queue.put_nowait(_unavailable(why))
        self._pending.clear()

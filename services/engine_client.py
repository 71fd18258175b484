"""The one client of the stage ring: send requests in, route results back. The HTTP ingress uses
it in its event loop; the offline pipeline runs it in an event-loop thread of its own
(``local_stack.py``).

One PUSH socket feeds the tokenizer workers, one PUSH reaches the engine directly (aborts,
session ends), and one PULL socket at this client's own ``reply_to`` address receives every
result addressed to it, dispatched on the message type:

* ``Admitted``: the engine took the request. A request whose consumer left before this is
  aborted now (an Abort sent earlier could overtake the request at the tokenizer and be lost);
  a request not admitted ``admit_timeout`` seconds after it was sent (its tokenizer worker
  died) is sent again, up to ``max_resends`` times (the engine admits a request id once, so a
  resend of a request that was only slow costs a tokenization). One still not admitted after
  that fails with 503, unless the last ``LoadReport`` shows the engine's step loop has not
  taken its input for ``admit_timeout`` (``engine_backlog_age_s``): one long step, such as a
  kernel compiling on first use, holds every new request back without losing any, and failing
  them would be a false 503. (A plain count of waiting requests would not do: under steady
  traffic with ~1 s steps it is rarely zero, and a request lost with a killed worker then
  waited a minute, until the traffic stopped, to be resent.)
* ``TextBatch``: new text; a finish ends the request.
* ``ErrorOut``: the request was refused or failed.
* ``LoadReport``: the answer to a Ping. Every ``ping_interval`` one Ping goes round the ring
  (through a tokenizer worker, which adds its counters) and one goes straight to the engine:
  the direct one is this client's heartbeat (the engine aborts the requests of a client it
  stops hearing from) and keeps the client healthy while no tokenizer worker is up, which fails
  new requests only. When no report comes back for ``dead_after`` seconds the client is
  unhealthy and every waiting request fails with 503.
* ``AdapterDone``: a LoRA adapter this client asked for was loaded or unloaded
  (``load_adapter`` / ``unload_adapter``); it brings the engine's whole adapter list. The list
  also comes with every ``LoadReport`` (``EngineStats.adapters``), so an ingress learns of the
  adapters another ingress of the same engine loaded within a Ping.
* ``StageStatus``: the launcher saw a stage die or come back (a notice without the launcher's
  token is ignored). While the engine or the detokenizer is down the client is unhealthy at
  once, and the requests in flight fail (their state died with the stage); a tokenizer worker's
  requests are resent to the others.

A request stays known until the engine has ended it, also after its consumer left, so that
``wait_ended`` can tell when its KV blocks are free. Whatever this client stops waiting for,
the engine is told to abort: a request it fails, and any request the engine admits or answers
that this client does not know (failed before it was admitted, or sent by an earlier ingress at
the same address), so that no generation outlives the one waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ..protocol import (
    Abort,
    AdapterDone,
    Addresses,
    Admitted,
    CancelSession,
    Codec,
    EngineIn,
    Endpoint,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressIn,
    LoadAdapter,
    LoadReport,
    Ping,
    SessionEnd,
    StageStatus,
    TextBatch,
    TokenizerIn,
    UnloadAdapter,
)
from ..protocol.checks import check_text_batch
from .stage import open_socket

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
    history_tokens: int = 0  # a session's tokens before this turn


class RequestError(Exception):
    """A request failed; ``status`` and the fields map onto the OpenAI error envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After

    @classmethod
    def from_wire(cls, err: ErrorOut) -> "RequestError":
        """From the ErrorOut a stage sent."""
        return cls(err.status, err.message, err.type, err.param, err.code)


_TIMED_OUT = object()  # put in a request's queue when it has run past the request timeout
RETRY_AFTER_S = 5  # what a 503 asks the client to wait
_RECENT_ABORTS = 4096  # unknown request ids already aborted, so a running one is not aborted every step
ADAPTER_TIMEOUT_S = 120.0  # a LoRA load reads a checkpoint between two steps: seconds, not minutes


def _needed_by_all(stage: str) -> bool:
    """Whether every request needs this stage (a tokenizer worker has peers)."""
    return stage in ("engine", "detokenizer")


def _unavailable(why: str) -> RequestError:
    return RequestError(503, why, type="service_unavailable", code="engine_unavailable", retry_after=RETRY_AFTER_S)


@dataclass
class _Request:
    """A request sent and not yet ended by the engine."""

    req: GenerateReq
    queue: asyncio.Queue
    sent_at: float
    resends: int = 0
    admitted: bool = False
    history_tokens: int = 0
    left_at: float | None = None  # when its consumer left (then the engine is told to abort it)

    def __post_init__(self) -> None:
        self.ended = asyncio.Event()


class EngineClient:
    """Async client of the stage ring (one per ingress process, one per pipeline)."""

    def __init__(self, addresses: Addresses, model_name: str, session_len: int, reply: Endpoint | None = None,
                 ping_interval: float = 0.5, dead_after: float = 10.0, admit_timeout: float = 3.0,
                 max_resends: int = 2, forget_after: float = 30.0, context: zmq.asyncio.Context | None = None,
                 request_timeout: float | None = None, adapter_paths: dict[str, str] | None = None):
        self.addresses = addresses
        self.model_name = model_name
        self.session_len = session_len
        self.reply = reply or addresses.reply_endpoint()
        self.reply_to = self.reply.connect
        self.ping_interval, self.dead_after = ping_interval, dead_after
        self.admit_timeout, self.max_resends = admit_timeout, max_resends
        self.forget_after = forget_after  # an abandoned request the engine never ends is forgotten then
        self.request_timeout = request_timeout  # a request running longer is aborted and fails with 504
        self._ctx = context or zmq.asyncio.Context.instance()
        self._requests: dict[str, _Request] = {}
        self._to_tokenizer_codec = Codec(TokenizerIn)
        self._to_engine_codec = Codec(EngineIn)
        self._in_codec = Codec(IngressIn)
        self._last_ring = 0.0
        self.load: LoadReport | None = None
        self.stages: dict[str, StageStatus] = {}  # what the launcher last said of each restarted stage
        self._tasks: list[asyncio.Task] = []
        self._aborted_unknown: OrderedDict[str, None] = OrderedDict()
        self.refused_notices = 0  # StageStatus frames without the launcher's token
        # LoRA adapters: their paths where this client knows them (given at start, or loaded
        # through it), the engine's list (name -> path or None), and the loads / unloads waiting
        # for the engine's answer, by request id.
        self._adapter_paths: dict[str, str] = dict(adapter_paths or {})
        self.adapters: dict[str, str | None] = {name: path for name, path in self._adapter_paths.items()}
        self._adapter_ops: dict[str, asyncio.Future] = {}
        self.adapter_timeout = ADAPTER_TIMEOUT_S

    # ---- lifetime ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind/connect the sockets and start the reader and health tasks."""
        a = self.addresses
        # a burst waits in the tokenizer feed's queue; past it, 503
        self._to_tokenizer = open_socket(self._ctx, zmq.PUSH, bind=a.tokenizer_in.bind, send_hwm=10_000, curve=a.curve)
        self._to_engine = open_socket(self._ctx, zmq.PUSH, connect=a.engine_in.connect, curve=a.curve)
        self._results = open_socket(self._ctx, zmq.PULL, bind=self.reply.bind, curve=a.curve)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        """Stop the tasks and close the sockets; waiting requests get 503."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.fail_all("the server is shutting down")
        for s in (self._to_tokenizer, self._to_engine, self._results):
            s.close(linger=0)

    # ---- health ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """True while a Ping went round the whole ring recently and no stage that every request
        needs (the engine, the detokenizer) is down."""
        ring = self._last_ring > 0 and time.monotonic() - self._last_ring < self.dead_after
        return ring and not any(_needed_by_all(name) for name in self.down)

    @property
    def down(self) -> list[str]:
        """The stages the launcher reported down and not yet back."""
        return sorted(name for name, st in self.stages.items() if not st.up)

    @property
    def serving_blocked_by(self) -> list[str]:
        """The stages down without which no request can be served: the engine, the detokenizer,
        or every tokenizer worker (one of several restarting leaves the others serving)."""
        down = [self.stages[name] for name in self.down]
        tokenizers = [st for st in down if st.name.startswith("tokenizer")]
        return sorted(st.name for st in down if _needed_by_all(st.name)
                      or (tokenizers and st in tokenizers and len(tokenizers) >= st.peers))

    @property
    def num_inflight(self) -> int:
        """Requests sent that still have a consumer and no end."""
        return sum(1 for r in self._requests.values() if r.left_at is None)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        """Send ``req`` and yield its outputs; closing the iterator early aborts the request."""
        if not self.healthy:
            raise _unavailable("the engine is not available (starting, stopped or unreachable); retry later")
        if req.rid in self._requests:
            raise RequestError(400, f"request id {req.rid!r} is already in flight", param="rid")
        req.reply_to = self.reply_to
        request = _Request(req, asyncio.Queue(), time.monotonic())
        self._requests[req.rid] = request
        ended, timer = False, None
        try:
            if not await self._send_to_tokenizer(req):
                ended = True
                self._requests.pop(req.rid, None)
                raise _unavailable("no tokenizer worker is taking requests; retry later")
            if self.request_timeout is not None:  # one timer a request, not one a token
                timer = asyncio.get_running_loop().call_later(self.request_timeout, request.queue.put_nowait,
                                                              _TIMED_OUT)
            while True:
                item = await request.queue.get()
                if item is _TIMED_OUT:  # ended False: the finally aborts it in the engine
                    raise RequestError(504, f"the request ran past the server's limit of {self.request_timeout:g}s "
                                       "and was stopped; ask for fewer tokens (max_tokens)", type="timeout",
                                       code="request_timeout")
                if isinstance(item, RequestError):
                    ended = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    ended = True
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if not ended:
                await self._leave(request)

    async def _leave(self, request: _Request) -> None:
        """The consumer is gone: abort the request now, or as soon as the engine admits it."""
        request.left_at = time.monotonic()
        if request.admitted:
            self._send_to_engine(Abort(request.req.rid))

    async def wait_ended(self, rids: list[str], timeout: float = 10.0) -> None:
        """Wait until the engine has ended each of ``rids`` (its KV blocks are free then)."""
        waits = [r.ended.wait() for rid in rids if (r := self._requests.get(rid)) is not None]
        if waits:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)

    async def end_session(self, session_id: int) -> None:
        """Abort a session's running turn and free its KV blocks in the engine."""
        self._send_to_engine(SessionEnd(session_id))

    async def cancel_session(self, session_id: int) -> None:
        """Abort a session's running turn; the session stays."""
        self._send_to_engine(CancelSession(session_id))

    async def load_adapter(self, name: str, path: str) -> list[str]:
        """Have the engine load the PEFT LoRA checkpoint at ``path`` as ``name``; returns every
        adapter loaded after it. RequestError as the engine refused it (400; 503 while it is down)."""
        self._adapter_paths[name] = path
        return await self._adapter_op(LoadAdapter(self._adapter_rid(), self.reply_to, name, path))

    async def unload_adapter(self, name: str) -> list[str]:
        """Have the engine forget the LoRA adapter ``name``; returns the adapters left (404 for one not loaded)."""
        return await self._adapter_op(UnloadAdapter(self._adapter_rid(), self.reply_to, name))

    @staticmethod
    def _adapter_rid() -> str:
        return f"lora-{uuid.uuid4().hex}"

    async def _adapter_op(self, msg: LoadAdapter | UnloadAdapter) -> list[str]:
        if not self.healthy:
            raise _unavailable("the engine is not available (starting, stopped or unreachable); retry later")
        done = self._adapter_ops[msg.rid] = asyncio.get_running_loop().create_future()
        try:
            self._send_to_engine(msg)
            return await asyncio.wait_for(done, self.adapter_timeout)
        except TimeoutError:
            raise RequestError(504, f"the engine did not answer within {self.adapter_timeout:g}s; GET /v1/models "
                               "shows whether the change happened", type="timeout", code="request_timeout") from None
        finally:
            self._adapter_ops.pop(msg.rid, None)

    def _set_adapters(self, names: list[str]) -> None:
        """The engine's adapter list, with the paths this client knows."""
        if list(self.adapters) != names:
            self.adapters = {name: self._adapter_paths.get(name) for name in names}

    async def _send_to_tokenizer(self, msg) -> bool:
        """Hand ``msg`` to a tokenizer worker without waiting; False when none can take it (no
        worker connected, or every worker's queue full): a send must never hang the caller."""
        try:
            await self._to_tokenizer.send(self._to_tokenizer_codec.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _send_to_engine(self, msg) -> None:
        """Hand ``msg`` to the engine without waiting (a NOBLOCK send is done at once; its future
        holds the outcome): dropped, and logged, when the engine's socket is full or gone."""
        try:
            sent = self._to_engine.send(self._to_engine_codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # closed: the client is shutting down
            return
        if sent.done() and sent.exception() is not None:
            logger.warning("engine socket full or unreachable; dropped %s", type(msg).__name__)

    def _end(self, rid: str, item: RequestOutput | RequestError | None = None) -> None:
        request = self._requests.pop(rid, None)
        if request is not None:
            if item is not None and request.left_at is None:
                request.queue.put_nowait(item)
            request.ended.set()

    # ---- results -----------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            frame = await self._results.recv(copy=False)
            try:
                msg = self._in_codec.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # a bad frame must not kill the reader
                self._in_codec.count_dropped(len(frame.buffer), exc)
                continue
            try:
                await self._dispatch(msg)
            except Exception:  # a well-formed but inconsistent message (ragged columns, ...)
                logger.exception("dropped a %s that could not be applied", type(msg).__name__)

    async def _dispatch(self, msg) -> None:
        if isinstance(msg, TextBatch):
            check_text_batch(msg)  # whole or not at all: a ragged batch must not be half-applied
            self._route_texts(msg)
        elif isinstance(msg, Admitted):
            self._admitted(msg)
        elif isinstance(msg, ErrorOut):
            op = self._adapter_ops.get(msg.rid)
            if op is not None:
                if not op.done():
                    op.set_exception(RequestError.from_wire(msg))
                return
            self._end(msg.rid, RequestError.from_wire(msg))
        elif isinstance(msg, AdapterDone):
            self._set_adapters(msg.adapters)
            op = self._adapter_ops.get(msg.rid)
            if op is not None and not op.done():
                op.set_result(list(msg.adapters))
        elif isinstance(msg, LoadReport):
            self._last_ring = time.monotonic()
            self._set_adapters(msg.engine.adapters)
            if self.load is not None:  # a direct report lacks the tokenizer's counters: keep the last ones
                msg.stage_stats = {**self.load.stage_stats, **msg.stage_stats}
            self.load = msg
        elif isinstance(msg, StageStatus):
            if not self.addresses.is_launcher_token(msg.token):
                self.refused_notices += 1
                logger.warning("ignored a stage notice without the launcher's token (%d so far)", self.refused_notices)
                return
            if msg.stats:  # the launcher's counters: shown with the stages' (kept across LoadReports)
                if self.load is not None:
                    self.load.stage_stats.update(msg.stats)
                return
            self.stages[msg.name] = msg
            if not msg.up and _needed_by_all(msg.name):
                logger.error("stage %s (pid %d) stopped: failing the requests in flight", msg.name, msg.pid)
                self.fail_all(f"the {msg.name} stage stopped and is being restarted; retry later")

    def _admitted(self, msg: Admitted) -> None:
        request = self._requests.get(msg.rid)
        if request is None:  # failed or forgotten here before the engine took it
            self._abort_unknown(msg.rid)
            return
        request.admitted = True
        request.history_tokens = msg.history_tokens
        if request.left_at is not None:
            self._send_to_engine(Abort(msg.rid))

    def _abort_unknown(self, rid: str) -> None:
        """Abort a request the engine runs for nobody here (once: later steps may still name it)."""
        if rid in self._aborted_unknown:
            return
        self._aborted_unknown[rid] = None
        while len(self._aborted_unknown) > _RECENT_ABORTS:
            self._aborted_unknown.popitem(last=False)
        self._send_to_engine(Abort(rid))

    def _route_texts(self, batch: TextBatch) -> None:
        for i, rid in enumerate(batch.rids):
            request = self._requests.get(rid)
            finish = batch.finish[i]
            if request is None:
                if finish < 0:
                    self._abort_unknown(rid)
                continue
            out = RequestOutput(
                text=batch.texts[i],
                token_ids=batch.token_ids[i],
                finish_reason=None if finish < 0 else Finish(finish).openai,
                prompt_tokens=batch.prompt_tokens[i],
                completion_tokens=batch.completion_tokens[i],
                cached_tokens=batch.cached[i],
                logprobs=batch.logprobs[i] if batch.logprobs is not None else None,
                history_tokens=request.history_tokens,
            )
            if finish >= 0:
                self._end(rid, out)
            elif request.left_at is None:
                request.queue.put_nowait(out)

    async def _watch(self) -> None:
        """Ping the ring; resend requests nobody admitted (a tokenizer died); fail all if the ring is down."""
        was_healthy = False
        while True:
            await asyncio.sleep(self.ping_interval)
            await self._send_to_tokenizer(Ping(self.reply_to, time.time()))  # dropped if none is connected
            self._send_to_engine(Ping(self.reply_to, time.time()))  # the heartbeat
            now = time.monotonic()
            if was_healthy and not self.healthy:
                logger.error("no answer from the engine for %.1fs: failing in-flight requests", self.dead_after)
                self.fail_all("the engine stopped answering; retry later")
            was_healthy = self.healthy
            stalled = (self.load is not None
                       and self.load.stage_stats.get("engine_backlog_age_s", 0.0) >= self.admit_timeout)
            for rid, request in list(self._requests.items()):
                if request.left_at is not None and now - request.left_at > self.forget_after:
                    self._end(rid)  # the engine never confirmed the abort: stop waiting for it
                elif request.admitted or now - request.sent_at < self.admit_timeout:
                    continue
                elif request.resends < self.max_resends:
                    request.resends += 1
                    logger.warning("request %s not admitted %.1fs after it was sent; resending (%d of %d)", rid,
                                   now - request.sent_at, request.resends, self.max_resends)
                    request.sent_at = now
                    await self._send_to_tokenizer(request.req)  # not taken: tried again next time
                elif stalled:
                    request.sent_at = now  # it may be waiting behind that step: its wait starts again
                else:
                    self._end(rid, _unavailable("no tokenizer worker took the request; retry later"))

    def fail_all(self, why: str) -> None:
        """End every waiting request with a 503 (the ring is down or the client closes), and tell
        the engine to abort them: a stage that died (the detokenizer) may leave the engine
        generating for nobody. A request not yet admitted is aborted when its Admitted comes."""
        admitted = [rid for rid, r in self._requests.items() if r.admitted]
        for rid in list(self._requests):
            self._end(rid, _unavailable(why))
        for op in self._adapter_ops.values():  # a LoRA load or unload: it may or may not have happened
            if not op.done():
                op.set_exception(_unavailable(f"{why} (GET /v1/models shows whether the adapter change happened)"))
        for rid in admitted:
            self._aborted_unknown[rid] = None  # its later outputs need no second Abort
            self._send_to_engine(Abort(rid))

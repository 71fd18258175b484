"""The service stages as threads of the user's process, over ``inproc://``: the pipeline's engine.

The same tokenizer, engine and detokenizer stage code as ``conveyor serve api_server``, and the
same ``EngineClient`` as the HTTP ingress, run in an event-loop thread of its own; this class
bridges its async API to the pipeline's threads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from ..engine.interface import Engine
from ..protocol import Addresses, GenerateReq
from .detokenizer.batches import Detokenizer
from .detokenizer.process import serve_detokenizer
from .engine.service import EngineService
from .engine_client import EngineClient, RequestError, RequestOutput
from .tokenizer.preprocess import Preprocessor
from .tokenizer.process import serve_tokenizer

logger = logging.getLogger(__name__)

_START_TIMEOUT = 30.0  # seconds for the first ping to go round the ring


class EngineDiedError(RuntimeError):
    """A stage thread stopped on an internal error; the pipeline must be recreated."""


class LocalStack:
    """Tokenizer, engine and detokenizer threads joined by inproc sockets, and their client."""

    def __init__(self, engine: Engine, preprocessor: Preprocessor):
        self.ctx = zmq.Context()
        self.addresses = Addresses.inproc()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._pumps: dict[str, Future] = {}
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="conveyor-client", daemon=True)
        self._loop_thread.start()
        # The client binds the tokenizer feed and its reply socket before any stage connects.
        self.client = EngineClient(self.addresses, "local", preprocessor.session_len,
                                   context=zmq.asyncio.Context.shadow(self.ctx.underlying))
        self._run(self.client.start())
        self.engine_service = EngineService(engine, self.ctx, self.addresses)
        stages = {
            "engine": lambda: self.engine_service.serve(self._stop),
            "detokenizer": lambda: serve_detokenizer(self.ctx, self.addresses, Detokenizer(preprocessor.tokenizer),
                                                     self._stop),
            "tokenizer": lambda: serve_tokenizer(self.ctx, self.addresses, preprocessor, self._stop),
        }
        self._threads = [threading.Thread(target=self._guard, args=(name, fn), name=f"conveyor-{name}", daemon=True)
                         for name, fn in stages.items()]
        for t in self._threads:
            t.start()
        self._run(self._until_healthy())

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _until_healthy(self) -> None:
        deadline = self.loop.time() + _START_TIMEOUT
        while not self.client.healthy and self.error is None and self.loop.time() < deadline:
            await asyncio.sleep(0.01)

    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # reported to every waiting request
            if self._stop.is_set():  # torn down mid-send by close(): nobody waits on it any more
                logger.debug("stage %s stopped during shutdown: %r", name, exc)
                return
            logger.exception("stage %s died", name)
            self.error = exc
            self.loop.call_soon_threadsafe(self.client.fail_all, f"the {name} stage died: {exc!r}")

    def _check(self) -> None:
        if self.error is not None:
            raise EngineDiedError(f"the engine stopped: {self.error!r}") from self.error

    # ---- requests ----------------------------------------------------------------------------
    def new_rid(self) -> str:
        """A fresh request id."""
        return f"local-{next(self._ids)}"

    def submit(self, req: GenerateReq, sink: queue.Queue, tag: int) -> None:
        """Send a request; its RequestOutputs (or its RequestError) arrive on ``sink`` as ``(tag, item)``."""
        self._check()
        self._pumps[req.rid] = asyncio.run_coroutine_threadsafe(self._pump(req, sink, tag), self.loop)

    async def _pump(self, req: GenerateReq, sink: queue.Queue, tag: int) -> None:
        try:
            async for out in self.client.generate(req):
                sink.put((tag, out))
        except RequestError as exc:
            sink.put((tag, exc))
        finally:
            self._pumps.pop(req.rid, None)

    def abort(self, rids: list[str]) -> None:
        """Stop requests; returns once the engine has ended them (their KV blocks are free)."""
        for rid in rids:
            pump = self._pumps.get(rid)
            if pump is not None:
                pump.cancel()  # closes its generate(), which aborts the request in the engine
        if self.error is None:
            self._run(self.client.wait_ended(rids))

    def end_session(self, session_id: int) -> None:
        """Free a session's KV blocks (done when this returns)."""
        if self.error is None:
            self.call(lambda engine: engine.end_session(session_id))

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps."""
        self._check()
        return self.engine_service.call(fn)

    def close(self) -> None:
        """Stop every stage thread, the client and its loop, and close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
        self.loop.close()
        self.ctx.term()


__all__ = ["EngineDiedError", "LocalStack", "RequestError", "RequestOutput"]

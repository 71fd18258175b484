"""The request body cap: a body is read whole before the app sees it, so its size and the time it
takes to arrive are bounded here (413 / 408) for the ingress and the proxy alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .errors import error_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, by Content-Length and by bytes really received.

    The body is read here in full (a chunked body has no Content-Length, and a client may send
    more than it announced) and replayed to the app; JSON bodies are read whole anyway.
    """

    def __init__(self, app: Any, max_bytes: int, timeout_s: float = 30.0):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, total = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:  # a client dripping its body must not hold a task and a socket
                await error_response(408, f"the request body did not arrive within {self.timeout_s:g}s",
                                     code="request_timeout", headers={"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nobody to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        await error_response(413, f"the request body exceeds {self.max_bytes} bytes",
                             code="request_too_large")(scope, receive, send)

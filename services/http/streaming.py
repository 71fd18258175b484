"""What every server-sent-event stream of the ingress and the proxy shares: the ``[DONE]`` end,
the error event of a stream that fails after its headers went out, and a response that always
closes its body and runs its cleanup, however the client leaves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine_client import RequestError
from .errors import error_envelope

_encode = msgspec.json.Encoder().encode
SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: RequestError) -> bytes:
    """The end of an SSE stream that failed after it started: an error event, then [DONE]
    (the ingress's streams and the proxy's relays end alike)."""
    return b"data: " + _encode(error_envelope(exc.status, exc.message, exc.type, exc.param, exc.code)) + \
        b"\n\n" + SSE_DONE


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs ``cleanup`` and closes its body, however the stream ends.

    Starlette leaves the body iterator suspended when the client disconnects while a chunk is
    being sent; closing it here, rather than whenever it is garbage collected, makes the engine
    abort the request (and free its KV blocks) at once and keeps the in-flight count exact.
    """

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: under a cancelled anyio scope every await would be cancelled again.
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
                finally:
                    await self._cleanup()

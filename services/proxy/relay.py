"""Forwarding one request to a node and relaying its answer in bounded memory: whole, in pieces,
or as SSE events as they arrive, with a node that stops sending cut off by read timeouts.

A streamed answer is passed on event by event (split at the blank line that ends an SSE event),
never buffered to the end and never cut inside an event, so that a node that fails midway leaves
the client a stream it can still parse: the events so far, an error event, then ``[DONE]``. A
non-streamed answer is buffered up to ``WHOLE_ANSWER_CAP`` bytes, so that a node failing while
it sends one still becomes a clean error envelope; past the cap the rest is passed through as it
comes, and a failure then can only cut the connection.

Timeouts (see ``DEFAULT_FIRST_BYTE_TIMEOUT_S`` and ``DEFAULT_CHUNK_TIMEOUT_S`` for the defaults):
the first bytes of a node's answer (its status line and headers) must come within the first-byte
timeout, and each later piece within the chunk timeout of the one before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response

from ..engine_client import RequestError
from ..http import DEFAULT_MAX_BODY_BYTES, sse_error

logger = logging.getLogger(__name__)

# Headers passed from the client to the node (the key, so a node with the same keys accepts the
# request) and from the node back to the client.
REQUEST_HEADERS = ("authorization", "content-type", "accept")
RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after", "www-authenticate")
# Connecting is quick or the node is gone, and a request body is small. Reads have no httpx
# timeout: the first-byte and chunk timeouts below bound them, as httpx has one read timeout
# for both and the two waits differ by orders of magnitude.
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
# A node's first bytes: an api_server sends its headers only once it has an answer, so a
# non-streamed request waits the whole generation and a stream waits its queueing and prefill.
# Both are bounded by the api_server's --request-timeout (600 s by default), after which it
# answers 504 itself; 20 s more lets a slow but live node answer first, so only a hung node is
# timed out (and quarantined). Lower it when the nodes' generations are known to be short.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 620.0
# Between two pieces of an answer: a stream's events come once per generated token, and a
# non-streamed body follows its headers at once, so a minute of silence means a stalled node.
DEFAULT_CHUNK_TIMEOUT_S = 60.0
# A non-streamed answer held whole (so a failure can still become a clean 502/504); answers are
# a few kB, larger only with many logprobs or an echoed prompt, and those are passed through.
WHOLE_ANSWER_CAP = 1024 * 1024
# One SSE event held until its blank line: the largest a node sends carries an echoed prompt,
# bounded by the body limit (times JSON's escapes); a node that never ends an event is cut off.
MAX_EVENT_BYTES = 4 * DEFAULT_MAX_BODY_BYTES


def request_headers(headers: dict[str, str] | object) -> dict[str, str]:
    """The client's headers the node needs."""
    return {k: v for k in REQUEST_HEADERS if (v := headers.get(k)) is not None}  # type: ignore[attr-defined]


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    """The node's headers the client needs (no hop-by-hop or length headers: the proxy re-frames)."""
    return {k: v for k in RESPONSE_HEADERS if (v := upstream.headers.get(k)) is not None}


def is_event_stream(upstream: httpx.Response) -> bool:
    """Whether the node answered with server-sent events."""
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


def node_error(url: str, exc: Exception) -> RequestError:
    """The error a client gets when its node fails or times out after taking the request."""
    if isinstance(exc, httpx.TimeoutException):
        return RequestError(504, f"the api_server {url} stopped answering ({exc}); it is taken out of routing: "
                            "retry the request", type="timeout", code="node_timeout")
    return RequestError(502, f"the api_server {url} failed while answering ({type(exc).__name__}); "
                        "it is taken out of routing: retry the request", type="service_unavailable",
                        code="node_failed")


async def send(http: httpx.AsyncClient, request: httpx.Request, first_byte_timeout_s: float) -> httpx.Response:
    """Send ``request`` and wait for the node's status line and headers (the body is left to
    read); httpx.ReadTimeout if they take longer than ``first_byte_timeout_s``."""
    try:
        return await asyncio.wait_for(http.send(request, stream=True), first_byte_timeout_s)
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"no answer within {first_byte_timeout_s:g}s", request=request) from None


async def paced(upstream: httpx.Response, chunk_timeout_s: float) -> AsyncIterator[bytes]:
    """The node's body as it arrives; httpx.ReadTimeout when a piece takes longer than
    ``chunk_timeout_s`` (then the connection is closed, which makes the node abort the request)."""
    pieces = upstream.aiter_bytes()
    try:
        while True:
            try:
                piece = await asyncio.wait_for(anext(pieces), chunk_timeout_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"nothing for {chunk_timeout_s:g}s mid-answer") from None
            yield piece
    finally:
        await pieces.aclose()


async def read_head(pieces: AsyncIterator[bytes], cap_bytes: int) -> tuple[bytes, bool]:
    """Up to about ``cap_bytes`` of an answer: ``(bytes, False)`` when that is all of it, ``(bytes,
    True)`` when more follows in ``pieces`` (raises httpx.HTTPError if the node breaks off)."""
    head = bytearray()
    async for piece in pieces:
        head += piece
        if len(head) > cap_bytes:
            return bytes(head), True
    return bytes(head), False


def whole(upstream: httpx.Response, body: bytes) -> Response:
    """The node's whole answer as the proxy's response."""
    return Response(body, status_code=upstream.status_code, headers=response_headers(upstream))


async def pass_through(head: bytes, pieces: AsyncIterator[bytes], url: str,
                       on_end: Callable[[bool, Exception | None], None]) -> AsyncIterator[bytes]:
    """An answer too large to hold: ``head``, then the rest of ``pieces`` as it arrives.

    ``on_end`` is called as in ``relay_events``. The status line has gone out by now, so a node
    that breaks off can only be reported by cutting the connection: the error is raised again,
    and the client sees a body that ended early rather than one that looks complete.
    """
    yield head
    try:
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                yield piece
    except httpx.HTTPError as exc:
        logger.warning("node %s broke off a large answer: %s %s", url, type(exc).__name__, exc)
        on_end(False, exc)
        raise
    on_end(True, None)


async def relay_events(upstream: httpx.Response, url: str, on_end: Callable[[bool, Exception | None], None], *,
                       chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT_S,
                       max_event_bytes: int = MAX_EVENT_BYTES) -> AsyncIterator[bytes]:
    """The node's SSE events, each passed on as soon as it is complete.

    ``on_end(completed, error)`` is called when the node ends the stream, ``(True, None)``, or
    breaks it off, stalls past ``chunk_timeout_s`` or sends an event over ``max_event_bytes``,
    ``(False, exc)``: the client then gets an error event and ``[DONE]``. A client that goes
    away stops the iteration; whoever owns ``upstream`` then closes it, which makes the node
    abort the request.
    """
    pending = b""
    try:
        async with contextlib.aclosing(paced(upstream, chunk_timeout_s)) as pieces:
            async for piece in pieces:
                pending += piece
                cut = pending.rfind(b"\n\n")
                if cut >= 0:
                    events, pending = pending[:cut + 2], pending[cut + 2:]
                    yield events
                if len(pending) > max_event_bytes:  # held until a blank line that may never come
                    raise httpx.RemoteProtocolError(f"an SSE event of over {max_event_bytes} bytes")
    except httpx.HTTPError as exc:
        logger.warning("node %s broke off a stream: %s %s", url, type(exc).__name__, exc)
        on_end(False, exc)
        yield sse_error(node_error(url, exc))
        return
    on_end(True, None)
    if pending:  # a stream whose last event lacks its blank line: pass it on as it is
        yield pending

"""Forwarding one request to a node and relaying its answer: whole, or as SSE events as they arrive.

A streamed answer is passed on event by event (split at the blank line that ends an SSE event),
never buffered to the end and never cut inside an event, so that a node that fails midway leaves
the client a stream it can still parse: the events so far, an error event, then ``[DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response

from ..engine_client import RequestError
from ..ingress.sse import sse_error

logger = logging.getLogger(__name__)

# Headers passed from the client to the node (the key, so a node with the same keys accepts the
# request) and from the node back to the client.
REQUEST_HEADERS = ("authorization", "content-type", "accept")
RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after", "www-authenticate")
# Waiting for a node: connecting is quick or the node is gone; a non-streamed answer arrives
# whole, after the generation, so reads wait as long as a node lets a request run (its
# --request-timeout default).
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=None)


def request_headers(headers: dict[str, str] | object) -> dict[str, str]:
    """The client's headers the node needs."""
    return {k: v for k in REQUEST_HEADERS if (v := headers.get(k)) is not None}  # type: ignore[attr-defined]


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    """The node's headers the client needs (no hop-by-hop or length headers: the proxy re-frames)."""
    return {k: v for k in RESPONSE_HEADERS if (v := upstream.headers.get(k)) is not None}


def is_event_stream(upstream: httpx.Response) -> bool:
    """Whether the node answered with server-sent events."""
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


def node_failed(url: str, exc: Exception) -> RequestError:
    """The error a client gets when its node fails after taking the request."""
    return RequestError(502, f"the api_server {url} failed while answering ({type(exc).__name__}); "
                        "it is taken out of routing: retry the request", type="service_unavailable",
                        code="node_failed")


async def whole(upstream: httpx.Response) -> Response:
    """The node's whole answer as the proxy's response (raises httpx.HTTPError if it breaks off)."""
    body = await upstream.aread()
    return Response(body, status_code=upstream.status_code, headers=response_headers(upstream))


async def relay_events(upstream: httpx.Response, url: str,
                       on_end: Callable[[bool, Exception | None], None]) -> AsyncIterator[bytes]:
    """The node's SSE events, each passed on as soon as it is complete.

    ``on_end(completed, error)`` is called when the node ends the stream, ``(True, None)``, or
    breaks it off, ``(False, exc)``: the client then gets an error event and ``[DONE]``. A client
    that goes away stops the iteration; whoever owns ``upstream`` then closes it, which makes the
    node abort the request.
    """
    pending = b""
    try:
        async for chunk in upstream.aiter_bytes():
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut >= 0:
                events, pending = pending[:cut + 2], pending[cut + 2:]
                yield events
    except httpx.HTTPError as exc:
        logger.warning("node %s broke off a stream: %s %s", url, type(exc).__name__, exc)
        on_end(False, exc)
        yield sse_error(node_failed(url, exc))
        return
    on_end(True, None)
    if pending:  # a stream whose last event lacks its blank line: pass it on as it is
        yield pending

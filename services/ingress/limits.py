"""How much one client may ask of the server, and how long it may take to ask.

Each limit is a flag of ``conveyor serve api_server`` (README, "Limits"). They bound the work a
single request can cause before the engine sees it (characters tokenized, engine requests made)
and the resources a client can hold without sending anything (sockets, queue places).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..engine_client import RETRY_AFTER_S
from ..http import DEFAULT_MAX_BODY_BYTES, error_envelope

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN_CAP = 32  # the default character cap: session_len tokens of this many characters each


@dataclass(frozen=True)
class IngressLimits:
    """Per-request and per-connection bounds of the HTTP ingress."""

    max_prompt_chars: int | None = None  # characters of a request's prompts, before tokenizing (None: 32 x session_len)
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_sequences: int = 256  # engine requests one HTTP request may make (n x prompts)
    max_queued: int = 1024  # engine requests in flight at this ingress; one more gets 429
    request_timeout_s: float | None = 600.0  # a request still running then is aborted (504 / an error event)
    header_timeout_s: float = 10.0  # a connection whose request headers take longer is closed
    body_timeout_s: float = 30.0  # a body that takes longer to arrive gets 408
    max_connections: int = 4096  # open connections and tasks; past it 503 (with_connection_limit)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a request body, read whole; past it 413 (images come inside)

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_sequences", "max_queued", "max_connections", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars={self.max_prompt_chars}: must be at least 1, or None")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s}: must be > 0, or None for no timeout")

    def prompt_chars_cap(self, session_len: int) -> int:
        """The character cap for a server whose context holds ``session_len`` tokens."""
        return self.max_prompt_chars or CHARS_PER_TOKEN_CAP * session_len


def with_header_timeout(protocol: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """``protocol`` (uvicorn's HTTP protocol class) closing a connection whose request headers
    are not complete ``timeout_s`` after the connection opened or its first bytes came: a client
    that sends headers slowly, or nothing, cannot hold a socket (uvicorn has no such timeout;
    its keep-alive timeout covers only the time between requests).

    uvicorn's protocols start a new ``cycle`` when a request's headers are complete; a timer
    that finds the same cycle as when it was armed, not serving a request, knows none began.
    """

    class HeaderTimeout(protocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _armed_cycle: object = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._arm()  # the next request's first bytes: its headers must follow in time
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._armed_cycle = getattr(self, "cycle", None)
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            started = getattr(self, "cycle", None) is not self._armed_cycle
            if not started and self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeout.__name__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeout


_OVER_CONNECTIONS = msgspec.json.encode(error_envelope(
    503, "the server has too many connections open: retry later", type="service_unavailable",
    code="too_many_connections"))
_OVER_CONNECTIONS_HEADERS = [(b"content-type", b"application/json"),
                             (b"content-length", str(len(_OVER_CONNECTIONS)).encode()),
                             (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]

_App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def with_connection_limit(protocol: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """``protocol`` (uvicorn's HTTP protocol class) answering a request past the server's
    ``limit_concurrency`` (``--max-connections``) with 503 in OpenAI's error envelope and
    ``Retry-After``, where uvicorn answers plain text without it (clients then neither parse the
    error nor know when to come back).

    The limit and what it counts stay uvicorn's (open connections, requests being served); the
    protocol takes the check over from uvicorn, which it turns off for its connections, and makes
    it as the request's app starts, when uvicorn has counted the request's own task already.
    """

    class ConnectionLimit(protocol):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            limit, self.limit_concurrency = self.limit_concurrency, None
            if limit is not None:
                self.app = self._refusing_past(limit, self.app)

        def _refusing_past(self, limit: int, app: _App) -> _App:
            async def limited(scope: dict, receive: Callable, send: Callable) -> None:
                # uvicorn's test, one task later: it is made before this request's task is counted
                if scope["type"] == "http" and (len(self.connections) >= limit or len(self.tasks) > limit):
                    logger.warning("over the connection limit (%d, --max-connections): 503", limit)
                    await send({"type": "http.response.start", "status": 503, "headers": _OVER_CONNECTIONS_HEADERS})
                    await send({"type": "http.response.body", "body": _OVER_CONNECTIONS})
                    return
                await app(scope, receive, send)
            return limited

    ConnectionLimit.__name__ = f"ConnectionLimit{protocol.__name__}"
    return ConnectionLimit

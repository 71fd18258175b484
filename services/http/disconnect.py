"""Work whose HTTP client went away is cancelled, not finished for nobody: the engine aborts a
request whose stream is closed, and the proxy closes a node's answer, which makes the node abort."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the HTTP client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task not in done and watch.exception() is not None:
            # The server cannot tell us about the connection: just wait for the work.
            logger.debug("disconnect watch failed: %r", watch.exception())
            done, _ = await asyncio.wait((task,))
    except BaseException:  # cancelled ourselves (server shutdown): leave nothing running
        watch.cancel()
        task.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()  # the engine stream inside is cancelled, which aborts the request
    await asyncio.wait((task,))
    raise ClientDisconnected()


async def _disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    # The body has been read, so the next message the server has for us is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass

"""An api_server's membership in a proxy (``api_server --proxy-url URL``): it joins once it
serves, and leaves when it starts draining on SIGTERM, so the proxy stops sending it requests
before it stops taking them. A server that dies without leaving is taken out by the proxy's
health checks instead.

Joining and leaving take one of the proxy's admin keys (``--proxy-admin-key-file`` or
``$CONVEYOR_PROXY_ADMIN_KEYS``, never a client key), or none from the proxy's own host when the
proxy has no admin keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import httpx

logger = logging.getLogger(__name__)

RETRY_MAX_S = 30.0  # joining retries (the proxy may start after its nodes), backing off to this
_REFUSAL_HINTS = {
    401: ": give this server one of the proxy's admin keys (--proxy-admin-key-file or $CONVEYOR_PROXY_ADMIN_KEYS)",
    403: ": a proxy without admin keys takes nodes only from its own host; start it with --admin-keys-file and "
         "this server with --proxy-admin-key-file",
}


def advertised_url(host: str, port: int) -> str:
    """The URL a proxy reaches this server at: a wildcard bind address is replaced by the host's name."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ProxyRegistration:
    """Joins ``proxy_url`` as ``node_url`` serving ``models`` (in the background, retrying while the
    proxy cannot be reached); ``leave()`` takes the node out again. ``admin_key``, when given, is
    sent as the Bearer key (a proxy with admin keys takes a node only from a caller with one)."""

    def __init__(self, proxy_url: str, node_url: str, models: list[str], admin_key: str | None = None):
        self.proxy_url, self.node_url, self.models = proxy_url.rstrip("/"), node_url, models
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._task: asyncio.Task | None = None
        self._leaving: asyncio.Task | None = None
        self.joined = False

    def start(self) -> None:
        """Begin joining (call on the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._join())

    async def _join(self) -> None:
        body = {"url": self.node_url, "status": {"models": self.models}}
        delay = 1.0
        async with httpx.AsyncClient(timeout=10.0) as http:
            while True:
                try:
                    answer = await http.post(f"{self.proxy_url}/nodes/add", json=body, headers=self._headers)
                except httpx.HTTPError as exc:
                    logger.warning("proxy %s not reachable (%s %s): retrying in %.0fs", self.proxy_url,
                                   type(exc).__name__, exc, delay)
                else:
                    if answer.status_code == 200:
                        self.joined = True
                        logger.info("joined proxy %s as %s", self.proxy_url, self.node_url)
                        return
                    hint = _REFUSAL_HINTS.get(answer.status_code, "")
                    if answer.status_code < 500:  # refused: retrying would not change the answer
                        logger.error("proxy %s refused this server (%d %s)%s", self.proxy_url, answer.status_code,
                                     answer.text[:300], hint)
                        return
                    logger.warning("proxy %s answered %d: retrying in %.0fs", self.proxy_url, answer.status_code,
                                   delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def leave(self) -> None:
        """Stop joining, and leave the proxy if joined (errors are logged: the proxy's health checks
        take out a node that is gone anyway). Every caller waits for the one departure: the drain
        starts it, and the server's exit must not cut it short."""
        if self._leaving is None:
            self._leaving = asyncio.get_running_loop().create_task(self._leave())
        await asyncio.shield(self._leaving)

    async def _leave(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not self.joined:
            return
        self.joined = False
        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                answer = await http.post(f"{self.proxy_url}/nodes/remove", json={"url": self.node_url},
                                         headers=self._headers)
            logger.info("left proxy %s (%d)", self.proxy_url, answer.status_code)
        except httpx.HTTPError as exc:
            logger.warning("could not leave proxy %s: %s %s", self.proxy_url, type(exc).__name__, exc)

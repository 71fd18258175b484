"""Bearer keys: reading a request's ``Authorization: Bearer <key>`` and checking it against the
keys a server was given, in constant time. The ingress guards /v1/* and /metrics with them; the
proxy guards its routes and, with keys of their own, its node table (``proxy/admin.py``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from .errors import error_response


def bearer_token(scope: dict) -> bytes | None:
    """The key of a request's ``Authorization: Bearer <key>`` header (None without one)."""
    auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, token = auth.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def is_one_of(token: bytes | None, keys: list[bytes]) -> bool:
    """Whether ``token`` is one of ``keys``, compared with every key: the time taken says nothing
    about which key is close."""
    return token is not None and any([hmac.compare_digest(token, k) for k in keys])


class ApiKeyGuard:
    """ASGI middleware: 401 unless ``Authorization: Bearer <key>`` names a known key, on the paths
    ``guarded`` names."""

    def __init__(self, app: Any, api_keys: list[str], guarded: Callable[[str], bool]):
        self.app, self.keys, self.guarded = app, [k.encode() for k in api_keys], guarded

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.guarded(scope.get("path", "")) and not self._ok(scope):
            await error_response(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                                 )(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: dict) -> bool:
        return is_one_of(bearer_token(scope), self.keys)

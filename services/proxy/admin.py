"""Who may change the proxy's node table (``POST /nodes/add``, ``POST /nodes/remove``).

Whoever changes the table decides where clients' prompts and API keys are sent, so these routes
take keys of their own, the admin keys (``--admin-keys``), and refuse a client's key: a client
key opens /v1/*, never routing. A proxy without admin keys takes node changes only from its own
host (a loopback peer), which is how an api_server with ``--proxy-url`` on the same machine
joins without a key. ``GET /nodes/status`` only reads, and stays with the client keys.

The peer is the one uvicorn reports: behind a reverse proxy on the same host that does not send
``X-Forwarded-For``, every request looks local, so such a deployment needs admin keys.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from ..http import bearer_token, error_response, is_one_of

logger = logging.getLogger(__name__)

STATUS_PATH = "/nodes/status"


def is_admin_path(path: str) -> bool:
    """Whether ``path`` changes the node table: everything under /nodes/ but the status."""
    return path.startswith("/nodes/") and path.rstrip("/") != STATUS_PATH


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is this host's (127.0.0.0/8, ::1, or IPv4-mapped loopback)."""
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:  # not an IP address (a Unix socket, a test client's name): not provably local
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def check_keys(api_keys: list[str] | None, admin_keys: list[str] | None) -> None:
    """ValueError when a key is both a client key and an admin key (a client could then route)."""
    shared = set(api_keys or ()) & set(admin_keys or ())
    if shared:
        raise ValueError(f"{len(shared)} key(s) are both API keys and admin keys: a client holding one could "
                         "change the proxy's routing; give the admin keys values of their own")


class AdminGuard:
    """ASGI middleware on the node routes: with ``admin_keys``, 401 unless ``Authorization: Bearer``
    names one (403 for a client key); without, 403 unless the peer is on this host."""

    def __init__(self, app: Any, admin_keys: list[str] | None, api_keys: list[str] | None = None,
                 guarded: Callable[[str], bool] = is_admin_path):
        check_keys(api_keys, admin_keys)
        self.app, self.guarded = app, guarded
        self.admin_keys = [k.encode() for k in admin_keys or ()]
        self.api_keys = [k.encode() for k in api_keys or ()]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.guarded(scope.get("path", "")):
            refusal = self._refusal(scope)
            if refusal is not None:
                logger.warning("refused %s %s from %s: %s", scope.get("method"), scope.get("path"),
                               (scope.get("client") or ("?",))[0], refusal.body.decode(errors="replace")[:200])
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict) -> Any:
        if not self.admin_keys:
            if is_loopback((scope.get("client") or (None,))[0]):
                return None
            return error_response(403, "this proxy has no admin key, so it changes its nodes only for requests "
                                  "from its own host: start it with --admin-keys-file (or --admin-keys, "
                                  "$CONVEYOR_PROXY_ADMIN_KEYS) and send 'Authorization: Bearer <admin key>'",
                                  type="permission_error", code="admin_key_required")
        token = bearer_token(scope)
        if is_one_of(token, self.admin_keys):
            return None
        if is_one_of(token, self.api_keys):
            return error_response(403, "that is a client API key: adding or removing nodes takes an admin key "
                                  "(the proxy's --admin-keys)", type="permission_error", code="admin_key_required")
        return error_response(401, "invalid or missing admin key: send 'Authorization: Bearer <admin key>' (the "
                              "proxy's --admin-keys)", code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})

"""``conveyor serve proxy``: the proxy app on uvicorn (uvloop), in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

import uvicorn

from ..stage import setup_logging
from .admin import is_loopback
from .app import DEFAULT_HEALTH_INTERVAL_S, build_proxy_app
from .relay import DEFAULT_CHUNK_TIMEOUT_S, DEFAULT_FIRST_BYTE_TIMEOUT_S
from .strategies import Strategy

logger = logging.getLogger(__name__)


def run_proxy(server_name: str = "127.0.0.1", server_port: int = 8000,
              strategy: Strategy | str = Strategy.MIN_EXPECTED_LATENCY, api_keys: list[str] | None = None,
              health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S, log_level: str = "INFO", *,
              admin_keys: list[str] | None = None, first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S,
              chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT_S) -> int:
    """Serve the proxy until stopped; returns the exit code."""
    setup_logging(log_level)
    if logging.getLogger().level > logging.DEBUG:  # httpx logs every health check at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_proxy_app(strategy, api_keys=api_keys, admin_keys=admin_keys, health_interval_s=health_interval_s,
                          first_byte_timeout_s=first_byte_timeout_s, chunk_timeout_s=chunk_timeout_s)
    logger.info("proxy (%s) on http://%s:%d: add nodes with POST /nodes/add or api_server --proxy-url",
                Strategy(strategy).value, server_name, server_port)
    if not admin_keys and server_name != "localhost" and not is_loopback(server_name):
        logger.warning("no admin key: nodes are added and removed only from this host; for api_servers on other "
                       "hosts start the proxy with --admin-keys-file and them with --proxy-admin-key-file")
    uvicorn.run(app, host=server_name, port=server_port, log_level=log_level.lower(), access_log=False,
                timeout_keep_alive=30)
    return 0

"""Health polling: every node's ``GET /health`` on a fixed interval takes failing nodes out of
routing and puts recovered ones back.

A node is down when its /health does not answer 200 within ``HEALTH_TIMEOUT_S`` (refused,
timed out, or 503 while it drains or a stage restarts). Requests also take a node out at once
when they cannot reach it (``app.py``); only a passing check puts it back, and not while the node
is quarantined for timing out (``nodes.py``: a hung node's /health still passes).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .nodes import Node, NodeTable

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


async def check(table: NodeTable, node: Node, http: httpx.AsyncClient) -> bool:
    """One health check of ``node``; updates its state in ``table`` and returns whether it is up."""
    try:
        response = await http.get(f"{node.url}/health", timeout=HEALTH_TIMEOUT_S)
        reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
    except httpx.HTTPError as exc:
        reason = f"/health failed: {type(exc).__name__} {exc}".rstrip()
    if node.url not in table.nodes:  # removed while the check ran
        return False
    if reason is None and not node.healthy:
        if table.quarantined(node):
            return False
        logger.info("node %s is healthy again: routing to it%s", node.url,
                    " (one request at a time until it answers one)" if node.timeouts else "")
        table.mark_up(node)
    elif reason is not None and (node.healthy or node.down_reason != reason):
        logger.warning("node %s is down (%s): not routing to it", node.url, reason)
        table.mark_down(node, reason)
    return reason is None


async def poll_forever(table: NodeTable, http: httpx.AsyncClient, interval_s: float) -> None:
    """Check every node each ``interval_s`` seconds, all at once, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        nodes = list(table.nodes.values())
        if nodes:
            await asyncio.gather(*(check(table, n, http) for n in nodes))

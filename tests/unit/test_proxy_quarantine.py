"""Issue 28, finding 3: a node that timed out stays out though its /health passes, for a
quarantine that doubles with each timeout, and comes back on probation (one request at a time)."""

from __future__ import annotations

import asyncio

import httpx

from conveyor.services.proxy import health
from conveyor.services.proxy.nodes import QUARANTINE_MAX_S, Node, NodeTable
from conveyor.services.proxy.strategies import Strategy


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table() -> tuple[NodeTable, _Clock, Node, Node]:
    clock = _Clock()
    table = NodeTable(Strategy.MIN_EXPECTED_LATENCY, quarantine_s=30.0, clock=clock)
    hung, other = table.add(Node("http://hung", ["m"])), table.add(Node("http://other", ["m"]))
    return table, clock, hung, other


def _health_passes(table: NodeTable, node: Node) -> bool:
    """One health check of ``node`` whose /health answers 200, as a hung api_server's does."""
    async def run() -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200))) as http:
            return await health.check(table, node, http)
    return asyncio.run(run())


def test_a_node_that_timed_out_stays_out_until_its_quarantine_ends():
    table, clock, hung, _ = _table()
    assert table.quarantine(hung, "timed out before answering") == 30.0
    assert not hung.healthy and "quarantined for 30s" in hung.down_reason
    clock.now += 29.0
    assert not _health_passes(table, hung) and not hung.healthy  # /health passing is not enough
    clock.now += 1.0
    assert _health_passes(table, hung) and hung.healthy


def test_back_from_quarantine_a_node_takes_one_request_at_a_time_until_it_answers_one():
    table, clock, hung, other = _table()
    table.quarantine(hung, "timed out")
    clock.now += 30.0
    _health_passes(table, hung)
    assert hung.probation
    first = table.begin(table.choose("m", exclude={other.url}))
    assert first.node is hung
    assert table.choose("m", exclude={other.url}) is None  # not a second one while the first is open
    assert table.choose("m") is other
    table.answered(hung)  # its headers came: it is alive
    assert table.choose("m", exclude={other.url}) is hung


def test_the_quarantine_doubles_with_each_timeout_until_a_request_is_served_in_full():
    table, clock, hung, _ = _table()
    lengths = []
    for _ in range(8):
        lengths.append(table.quarantine(hung, "timed out"))
        clock.now += lengths[-1]
        _health_passes(table, hung)
    assert lengths == [30, 60, 120, 240, 480, 960, QUARANTINE_MAX_S, QUARANTINE_MAX_S]
    table.finish(table.begin(hung), completed=True)
    assert hung.timeouts == 0 and not hung.probation
    assert table.quarantine(hung, "timed out") == 30.0


def test_requests_that_time_out_together_are_one_timeout():
    table, clock, hung, _ = _table()
    table.quarantine(hung, "timed out")
    clock.now += 0.5
    table.quarantine(hung, "timed out")  # a second request sent before the first timed out
    assert hung.timeouts == 1 and hung.quarantined_until == 1030.0


def test_a_node_added_again_starts_afresh():
    table, _, hung, _ = _table()
    table.quarantine(hung, "timed out")
    entry = table.add(Node("http://hung", ["m"]))  # its api_server restarted and joined again
    assert entry is hung and hung.healthy and hung.timeouts == 0 and not table.quarantined(hung)

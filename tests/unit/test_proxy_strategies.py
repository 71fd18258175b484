"""The proxy's dispatch strategies and node table, without a network (services/proxy)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from conveyor.services.proxy import Candidate, Node, NodeTable, Strategy, pick
from conveyor.services.proxy.nodes import LATENCY_WINDOW


def _draws(strategy: Strategy, nodes: list[Candidate], n: int = 4000, seed: int = 0) -> Counter:
    rng = random.Random(seed)
    return Counter(pick(strategy, nodes, rng).url for _ in range(n))


def test_no_candidate_gives_none():
    for strategy in Strategy:
        assert pick(strategy, [], random.Random(0)) is None


def test_random_is_weighted_by_speed():
    counts = _draws(Strategy.RANDOM, [Candidate("a", speed=3), Candidate("b", speed=1)])
    assert counts["a"] / counts["b"] == pytest.approx(3.0, rel=0.1)


def test_random_gives_a_node_without_speed_the_average_speed():
    # a: 1, b: 3, c: unknown -> 2 (the average): shares 1/6, 3/6, 2/6
    counts = _draws(Strategy.RANDOM, [Candidate("a", speed=1), Candidate("b", speed=3), Candidate("c")], n=6000)
    assert counts["c"] / 6000 == pytest.approx(2 / 6, abs=0.03)
    assert counts["a"] / 6000 == pytest.approx(1 / 6, abs=0.03)


def test_random_without_speeds_spreads_evenly():
    counts = _draws(Strategy.RANDOM, [Candidate("a"), Candidate("b"), Candidate("c")], n=3000)
    assert all(abs(counts[u] - 1000) < 150 for u in "abc"), counts


def test_min_expected_latency_sends_to_the_shorter_queue_per_speed():
    rng = random.Random(0)
    assert pick(Strategy.MIN_EXPECTED_LATENCY, [Candidate("a", unfinished=3), Candidate("b", unfinished=1)],
                rng).url == "b"
    # a is four times faster: 3 requests there clear before 1 at b
    assert pick(Strategy.MIN_EXPECTED_LATENCY, [Candidate("a", speed=4, unfinished=3),
                                                Candidate("b", speed=1, unfinished=1)], rng).url == "a"


def test_min_expected_latency_breaks_ties_at_random():
    counts = _draws(Strategy.MIN_EXPECTED_LATENCY, [Candidate("a"), Candidate("b")], n=1000)
    assert min(counts.values()) > 350, counts


def test_min_observed_latency_prefers_the_faster_node_and_tries_unmeasured_ones_first():
    rng = random.Random(0)
    fast, slow = Candidate("fast", latencies=[0.1, 0.3]), Candidate("slow", latencies=[0.5, 0.4])
    assert pick(Strategy.MIN_OBSERVED_LATENCY, [slow, fast], rng).url == "fast"
    assert pick(Strategy.MIN_OBSERVED_LATENCY, [slow, fast, Candidate("new")], rng).url == "new"


def test_table_routes_only_to_healthy_nodes_serving_the_model():
    table = NodeTable(Strategy.RANDOM, random.Random(0))
    table.add(Node("http://a", ["m1"]))
    table.add(Node("http://b", ["m1", "m2"]))
    assert table.choose("m2").url == "http://b"
    assert table.choose("m3") is None
    table.mark_down(table.nodes["http://b"], "test")
    assert table.choose("m2") is None
    assert {table.choose(None).url for _ in range(20)} == {"http://a"}
    assert table.serves("m2")  # down, still known: a 503, not a 404
    table.mark_up(table.nodes["http://b"])
    assert table.choose("m2").url == "http://b"
    assert [c["id"] for c in table.model_cards()] == ["m1", "m2"]


def test_table_counts_requests_and_keeps_a_window_of_completed_latencies():
    table = NodeTable(Strategy.MIN_OBSERVED_LATENCY)
    node = table.add(Node("http://a", ["m"]))
    dispatches = [table.begin(node) for _ in range(LATENCY_WINDOW + 5)]
    assert table.status()["http://a"]["unfinished"] == LATENCY_WINDOW + 5
    table.finish(dispatches[0], completed=False)  # a failure says nothing about speed
    assert not node.latencies
    for d in dispatches[1:]:
        table.finish(d, completed=True)
    assert node.unfinished == 0
    assert len(table.status()["http://a"]["latency"]) == LATENCY_WINDOW


def test_readding_a_node_updates_it_in_place():
    table = NodeTable(Strategy.MIN_EXPECTED_LATENCY)
    first = table.add(Node("http://a", ["m"]))
    in_flight = table.begin(first)
    again = table.add(Node("http://a", ["m", "n"], speed=2.0))
    assert again is first and again.models == ["m", "n"] and again.speed == 2.0
    table.finish(in_flight, completed=True)  # the request sent before counts out of the same entry
    assert again.unfinished == 0 and len(again.latencies) == 1
    assert table.remove("http://a") and not table.remove("http://a")

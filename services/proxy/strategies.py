"""How the proxy picks a node for a request: LMDeploy's three dispatch strategies.

* ``random``: a draw weighted by each node's ``speed`` (a throughput the operator gives in
  ``/nodes/add``, e.g. requests per minute); a node without one counts as the average of those
  given, or 1 when none is.
* ``min_expected_latency``: the node whose queue would clear first, ``unfinished / speed``
  (requests the proxy has in flight there, times the expected time per request); ties are broken
  at random so that idle nodes share a light load.
* ``min_observed_latency``: the node with the smallest mean latency over its last
  ``LATENCY_WINDOW`` completed requests. A node with no completed request yet is tried first
  (LMDeploy counts it as infinitely slow, so a node added later never gets traffic).

Each strategy is a pure function of the candidates' numbers and a random source, so the unit
tests drive them without a network.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class Strategy(str, Enum):
    """The ``--strategy`` names, LMDeploy's spelling."""

    RANDOM = "random"
    MIN_EXPECTED_LATENCY = "min_expected_latency"
    MIN_OBSERVED_LATENCY = "min_observed_latency"


@dataclass
class Candidate:
    """What a strategy sees of a node that is up and serves the requested model."""

    url: str
    speed: float | None = None  # the operator's throughput figure; None: not given
    unfinished: int = 0  # requests the proxy has sent there and not seen end
    latencies: Sequence[float] = field(default_factory=tuple)  # seconds, the last completed requests


def _speeds(nodes: Sequence[Candidate]) -> list[float]:
    """Each node's speed, the missing ones filled in with the average of the given ones (or 1)."""
    given = [n.speed for n in nodes if n.speed is not None]
    fill = sum(given) / len(given) if given else 1.0
    return [n.speed if n.speed is not None else fill for n in nodes]


def _lowest(nodes: Sequence[Candidate], scores: Sequence[float], rng: random.Random) -> Candidate:
    """The node with the smallest score; among equals, one at random."""
    best = min(scores)
    return rng.choice([n for n, s in zip(nodes, scores) if s == best])


def pick_random(nodes: Sequence[Candidate], rng: random.Random) -> Candidate:
    """A node drawn with probability proportional to its speed."""
    return rng.choices(list(nodes), weights=_speeds(nodes))[0]


def pick_min_expected_latency(nodes: Sequence[Candidate], rng: random.Random) -> Candidate:
    """The node whose in-flight requests would finish first at its speed."""
    return _lowest(nodes, [n.unfinished / s for n, s in zip(nodes, _speeds(nodes))], rng)


def pick_min_observed_latency(nodes: Sequence[Candidate], rng: random.Random) -> Candidate:
    """The node with the smallest mean recent latency; unmeasured nodes first."""
    return _lowest(nodes, [sum(n.latencies) / len(n.latencies) if n.latencies else -1.0 for n in nodes], rng)


_PICKERS: dict[Strategy, Callable[[Sequence[Candidate], random.Random], Candidate]] = {
    Strategy.RANDOM: pick_random,
    Strategy.MIN_EXPECTED_LATENCY: pick_min_expected_latency,
    Strategy.MIN_OBSERVED_LATENCY: pick_min_observed_latency,
}


def pick(strategy: Strategy, nodes: Sequence[Candidate], rng: random.Random) -> Candidate | None:
    """The node ``strategy`` sends the next request to; None when there is no candidate."""
    return _PICKERS[strategy](nodes, rng) if nodes else None

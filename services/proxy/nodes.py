"""The proxy's table of api_server nodes: what each serves, whether it is up, its load and latencies.

Everything here runs on the proxy's one event loop, so the table needs no lock. A node is taken
out of routing (``healthy = False``) when a health check or a request to it fails, and put back
when a health check passes again; only ``/nodes/remove`` forgets it.

A node that *times out* is quarantined as well: a hung node (one that accepts requests and never
answers, or stalls mid-answer) still passes its ``/health``, so the next health check would put
it straight back and it would swallow the next clients too. Its health checks are ignored until
the quarantine ends, and the quarantine doubles with each timeout since it last served a request
in full (``QUARANTINE_S`` up to ``QUARANTINE_MAX_S``): a node that hangs once (a stuck request, a
long pause) is back soon, one that keeps hanging costs a client ever more rarely. Back from
quarantine it is on probation, taking one request at a time until it answers one, so that it
cannot gather a queue of clients before it shows whether it still hangs. Doubling was chosen
over a fixed long quarantine (which would keep a healthy node out for long after one stuck
request) and over probing with a real generation (which needs a model, a key and tokens of the
node's capacity on every check).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .strategies import Candidate, Strategy, pick

LATENCY_WINDOW = 15  # completed requests a node's observed latency averages over (LMDeploy's deque length)
QUARANTINE_S = 30.0  # a node's first timeout keeps it out this long; each further one doubles it
QUARANTINE_MAX_S = 1800.0


@dataclass
class Node:
    """One api_server behind the proxy."""

    url: str  # e.g. http://10.0.0.5:23333, no trailing slash
    models: list[str]
    speed: float | None = None  # the operator's throughput figure for the random / expected-latency strategies
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # model id -> its /v1/models entry
    unfinished: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    healthy: bool = True
    down_reason: str | None = None
    timeouts: int = 0  # since it last served a request in full: how long its next quarantine is
    quarantined_until: float = 0.0  # the table's clock; health checks do not put it back before
    probation: bool = False  # back from a quarantine: one request at a time until it answers one

    def status(self) -> dict[str, Any]:
        """This node in ``/nodes/status`` (LMDeploy's fields, plus ``healthy``, why it is down and
        its timeouts since it last served a request in full)."""
        return {"models": list(self.models), "unfinished": self.unfinished, "latency": list(self.latencies),
                "speed": self.speed, "healthy": self.healthy, "down_reason": self.down_reason,
                "timeouts": self.timeouts}


@dataclass
class Dispatch:
    """A request handed to a node: ``NodeTable.finish`` counts it out."""

    node: Node
    start: float


class NodeTable:
    """The nodes, and the choice of one for each request by the configured strategy."""

    def __init__(self, strategy: Strategy, rng: random.Random | None = None, quarantine_s: float = QUARANTINE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.strategy = strategy
        self.nodes: dict[str, Node] = {}
        self.quarantine_s = quarantine_s
        self.clock = clock
        self._rng = rng or random.Random()

    def add(self, node: Node) -> Node:
        """Add ``node``; a URL already there is updated in place (requests in flight there hold
        its entry and count themselves out of it), and starts afresh: a node joins again when
        its api_server restarts, or when an admin adds it back. Returns the table's entry."""
        old = self.nodes.get(node.url)
        if old is None:
            self.nodes[node.url] = node
            return node
        old.models, old.speed, old.cards = node.models, node.speed, node.cards
        old.healthy, old.down_reason = node.healthy, node.down_reason
        old.timeouts, old.quarantined_until, old.probation = node.timeouts, node.quarantined_until, node.probation
        return old

    def remove(self, url: str) -> bool:
        """Forget a node; False if it was not there. Its requests in flight run to their end."""
        return self.nodes.pop(url, None) is not None

    def serves(self, model: str) -> bool:
        """Whether any node, up or down, serves ``model``."""
        return any(model in n.models for n in self.nodes.values())

    def up(self) -> list[Node]:
        """The nodes taking requests."""
        return [n for n in self.nodes.values() if n.healthy]

    def choose(self, model: str | None, exclude: set[str] = frozenset()) -> Node | None:
        """The node the strategy picks among the healthy ones serving ``model`` (None: any model)."""
        nodes = [n for n in self.up() if n.url not in exclude and (model is None or model in n.models)
                 and not (n.probation and n.unfinished)]
        picked = pick(self.strategy, [Candidate(n.url, n.speed, n.unfinished, n.latencies) for n in nodes], self._rng)
        return None if picked is None else self.nodes[picked.url]

    def begin(self, node: Node) -> Dispatch:
        """Count a request in at ``node``."""
        node.unfinished += 1
        return Dispatch(node, self.clock())

    def answered(self, node: Node) -> None:
        """``node`` began an answer (its headers came): it takes requests side by side again."""
        node.probation = False

    def finish(self, dispatch: Dispatch, completed: bool) -> None:
        """Count a request out; a completed one adds its latency to the node's window (a failed or
        refused one says nothing about how fast the node serves) and clears its timeouts."""
        node = dispatch.node
        node.unfinished -= 1
        if completed:
            node.latencies.append(self.clock() - dispatch.start)
            node.timeouts, node.probation = 0, False

    def mark_down(self, node: Node, reason: str) -> None:
        """Take ``node`` out of routing until a health check passes."""
        node.healthy, node.down_reason = False, reason

    def quarantine(self, node: Node, reason: str) -> float:
        """Take out ``node``, which timed out, for a quarantine that doubles with each timeout
        (see the module's docstring); returns its length in seconds. Requests that time out
        together count once: they are one hang, not several."""
        if not self.quarantined(node):
            node.timeouts += 1
            seconds = min(self.quarantine_s * 2 ** (node.timeouts - 1), QUARANTINE_MAX_S)
            node.quarantined_until = self.clock() + seconds
        seconds = node.quarantined_until - self.clock()
        self.mark_down(node, f"{reason}; quarantined for {seconds:.0f}s")
        return seconds

    def quarantined(self, node: Node) -> bool:
        """Whether ``node`` must stay out whatever its health checks say."""
        return self.clock() < node.quarantined_until

    def mark_up(self, node: Node) -> None:
        """Put ``node`` back into routing (on probation if it has timed out)."""
        node.healthy, node.down_reason = True, None
        node.probation = node.timeouts > 0

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: each model served by a healthy node, once."""
        cards: dict[str, dict[str, Any]] = {}
        for node in self.up():
            for model in node.models:
                cards.setdefault(model, node.cards.get(model) or {
                    "id": model, "object": "model", "created": int(time.time()), "owned_by": "conveyor",
                    "root": model, "parent": None, "permission": []})
        return list(cards.values())

    def status(self) -> dict[str, dict[str, Any]]:
        """``/nodes/status``: URL -> the node's status."""
        return {url: node.status() for url, node in self.nodes.items()}

"""Prometheus metrics of the HTTP ingress, served at GET /metrics.

Each app has its own registry (several apps in one process, as in tests, must not collide).
Engine gauges read the client's last LoadReport when scraped, so they cost nothing per request.
While the stage ring is silent or a stage is down that report is stale: the engine gauges read
NaN and the stage counters are left out, rather than a dead engine's last numbers. The ingress's
own bad-frame count (``conveyor_stage_stat{stat="ingress_bad_frames"}``) is read from its engine
client at scrape time and always shown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger(__name__)
access_log = logging.getLogger("conveyor.access")  # one INFO line per request; --log-level WARNING hides it

# Seconds. TTFT spans queueing + prefill; ITL is one decode step; E2E a whole request.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 2.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class IngressMetrics:
    """Every metric the ingress exports; ``client`` is read for the engine gauges at scrape time."""

    def __init__(self, client: Any, inflight: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("conveyor_http_requests", "HTTP responses by route template and status.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens of finished engine requests.",
                                     registry=r)
        self.completion_tokens = Counter("conveyor_generation_tokens",
                                         "Generated tokens of finished engine requests.", registry=r)
        self.cached_tokens = Counter("conveyor_prefix_cache_hit_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        Gauge("conveyor_requests_in_flight", "Generation requests being served by this ingress.",
              registry=r).set_function(inflight)
        Gauge("conveyor_engine_healthy", "1 while the stage ring answers pings.",
              registry=r).set_function(lambda: 1.0 if client.healthy else 0.0)
        self._load_gauge(client, "conveyor_engine_requests_running", "Requests the engine is running.", "running")
        self._load_gauge(client, "conveyor_engine_requests_waiting", "Requests queued in the engine.", "waiting")
        self._load_gauge(client, "conveyor_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
                         "kv_usage")
        self._load_gauge(client, "conveyor_engine_generated_tokens", "Tokens the engine generated since it started.",
                         "generated_tokens")
        r.register(_StageMetrics(client))
        self.ttft = Histogram("conveyor_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("conveyor_inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds", "Arrival to the end of the response.",
                             buckets=_E2E_BUCKETS, registry=r)

    def _load_gauge(self, client: Any, name: str, doc: str, field: str) -> None:
        def read() -> float:
            load = client.load
            return float(getattr(load.engine, field)) if load is not None and client.healthy else float("nan")
        Gauge(name, doc, registry=self.registry).set_function(read)

    def track(self, start: float) -> "RequestStats":
        """Latency and token accounting for one engine request that arrived at ``start`` (perf_counter)."""
        return RequestStats(self, start)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class _StageMetrics:
    """What the stages report: each stage's busy seconds and item counts (as the last ring ping
    collected them), and, per stage the launcher restarted, whether it is up and how often."""

    def __init__(self, client: Any):
        self._client = client

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = GaugeMetricFamily("conveyor_stage_stat", "Counters reported by each stage (busy seconds, items).",
                                  labels=["stat"])
        fresh = self._client.healthy
        for name, value in sorted((getattr(self._client.load, "stage_stats", None) or {}).items() if fresh else ()):
            stats.add_metric([name], float(value))
        # The ingress's own socket: the frames its engine client could not decode and dropped. The
        # stages report theirs on the ring's pings; this count is this process's, so always current.
        codec = getattr(self._client, "_in_codec", None)  # EngineClient's result-socket codec
        if codec is not None:
            stats.add_metric(["ingress_bad_frames"], float(codec.dropped))
        up = GaugeMetricFamily("conveyor_stage_up", "1 while the stage runs (stages that were restarted).",
                               labels=["stage"])
        restarts = GaugeMetricFamily("conveyor_stage_restarts", "Restarts in the launcher's window.",
                                     labels=["stage"])
        for name, st in sorted(self._client.stages.items()):
            up.add_metric([name], 1.0 if st.up else 0.0)
            restarts.add_metric([name], float(st.restarts))
        yield from (stats, up, restarts)


class RequestStats:
    """Observes one engine request's outputs; ``close`` adds its tokens to the counters once."""

    __slots__ = ("_m", "_start", "_last", "prompt_tokens", "completion_tokens", "cached_tokens", "failed",
                 "_closed")

    def __init__(self, metrics: IngressMetrics, start: float):
        self._m, self._start, self._last = metrics, start, None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.failed = False  # the engine client raised (the request never ran, or broke)
        self._closed = False

    def observe(self, out: Any) -> None:
        """Record the arrival of one RequestOutput."""
        n = len(out.token_ids)
        if n:
            now = time.perf_counter()
            if self._last is None:
                self._m.ttft.observe(now - self._start)
            else:
                # A delta may carry several tokens (the ingress lagged): spread the gap over them.
                gap = (now - self._last) / n
                for _ in range(n):
                    self._m.itl.observe(gap)
            self._last = now
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens

    def close(self) -> None:
        """The request ended (finished, failed or aborted): count its tokens."""
        if self._closed:
            return
        self._closed = True
        self._m.prompt_tokens.inc(self.prompt_tokens)
        self._m.completion_tokens.inc(self.completion_tokens)
        self._m.cached_tokens.inc(self.cached_tokens)


class RequestCounter:
    """ASGI middleware counting every HTTP response by route template (not raw path) and status,
    and writing the access log: client, method, path, status, seconds (a stream's whole length)."""

    def __init__(self, app: Any, metrics: IngressMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees when the app raises before answering
        start = time.perf_counter()

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router stores the matched route in the scope; unmatched paths share one label
            # so that probing random URLs cannot grow the label set without bound.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route, str(status)).inc()
            if access_log.isEnabledFor(logging.INFO):
                host, port = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s" %d %.3fs', host, port, scope.get("method"), scope.get("path"),
                                status, time.perf_counter() - start)

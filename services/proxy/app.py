"""The proxy's HTTP app: LMDeploy's request distributor in front of several api_servers.

Routes: the node table (``GET /nodes/status``, ``POST /nodes/add``, ``POST /nodes/remove``,
LMDeploy's bodies), the models of the nodes that are up (``GET /v1/models``, ``GET
/v1/models/{id}``), the OpenAI routes passed to a node the strategy picks (``POST
/v1/chat/completions``, ``POST /v1/completions``), ``GET /health`` (200 while a node is up) and
FastAPI's /docs.

A request body is forwarded as it came (the node validates it; its errors come back as they
are), with the client's ``Authorization`` header: give the proxy and its nodes the same keys.
With ``api_keys`` the proxy itself also wants one on /v1/* and ``/nodes/status``. Adding and
removing nodes takes an admin key instead, or without ``admin_keys`` a request from this host
(``admin.py``).

What the client sees when nodes fail: no node up (or none serving the model) is a 503 envelope;
a node that cannot be reached or answers 503 (draining, a stage restarting) is taken out and the
request goes to another; a node that breaks off after taking the request is taken out and the
client gets 502, or in a stream an error event and ``[DONE]``; a node that takes the request and
then sends nothing for the first-byte or chunk timeout is quarantined (``nodes.py``) and the
client gets 504 (or the error event). A client that goes away closes the node's response, so
the node aborts the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ..engine_client import RETRY_AFTER_S, RequestError
from ..http import (DEFAULT_MAX_BODY_BYTES, ApiKeyGuard, BodyLimit, ClosingStreamingResponse, error_response,
                    install_error_handlers, until_disconnected)
from . import health
from .admin import STATUS_PATH, AdminGuard, check_keys
from .nodes import QUARANTINE_S, Dispatch, Node, NodeTable
from .relay import (DEFAULT_CHUNK_TIMEOUT_S, DEFAULT_FIRST_BYTE_TIMEOUT_S, TIMEOUT, WHOLE_ANSWER_CAP,
                    is_event_stream, node_error, paced, pass_through, read_head, relay_events, request_headers,
                    response_headers, send, whole)
from .strategies import Strategy

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_INTERVAL_S = 5.0
ADDED, DELETED = "Added successfully", "Deleted successfully"  # LMDeploy's answers, which its clients print


class NodeStatusIn(BaseModel):
    """What an operator (or a registering api_server) may say about a node."""

    model_config = ConfigDict(extra="forbid")
    models: list[str] = Field(default_factory=list,
                              description="the models it serves; empty: asked from the node's /v1/models")
    speed: float | None = Field(default=None, gt=0, description="its throughput (any unit, the same for all "
                                "nodes), weighing the random and min_expected_latency strategies")


class NodeIn(BaseModel):
    """``/nodes/add`` and ``/nodes/remove``: ``{"url": "http://host:23333", "status": {...}}``."""

    model_config = ConfigDict(extra="forbid")
    url: str
    status: NodeStatusIn | None = None


def _node_url(url: str) -> str:
    """``url`` without a trailing slash; 400 unless it is an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise RequestError(400, f"url {url!r} is not a URL: {exc}", param="url") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise RequestError(400, f"url {url!r}: give the api_server's address as http://HOST:PORT", param="url")
    return str(parsed).rstrip("/")


def _peek(body: bytes) -> tuple[str | None, bool]:
    """(model, stream) from a request body; 400 for a body that is not a JSON object."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object")
    model = data.get("model")
    return (model if isinstance(model, str) else None), data.get("stream") is True


class _Proxy:
    """The app's state (the node table, one HTTP client to the nodes) and the forwarding flow."""

    def __init__(self, table: NodeTable, node_key: str | None, first_byte_timeout_s: float, chunk_timeout_s: float,
                 whole_answer_cap: int):
        self.table = table
        # Sent to a node's /v1/models when an admin adds it without its models: the proxy's own
        # client key (its nodes take the clients' keys), never the caller's, an admin key.
        self.node_key = node_key
        self.first_byte_timeout_s, self.chunk_timeout_s = first_byte_timeout_s, chunk_timeout_s
        self.whole_answer_cap = whole_answer_cap
        self.http = httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None,
                                                                           max_keepalive_connections=64))

    def unavailable(self, model: str | None) -> RequestError:
        """The 503 for a request no node can take, naming the nodes that are down and why."""
        what = "no api_server" if model is None else f"no api_server serving `{model}`"
        down = [f"{n.url} ({n.down_reason})" for n in self.table.nodes.values() if not n.healthy]
        detail = f"down: {', '.join(down)}" if down else "none is registered (POST /nodes/add)"
        return RequestError(503, f"{what} is up to take the request; {detail}", type="service_unavailable",
                            code="no_node_available", retry_after=RETRY_AFTER_S)

    async def open(self, path: str, body: bytes, headers: dict[str, str], model: str | None
                   ) -> tuple[httpx.Response, Dispatch]:
        """Send the request to a node and wait for its response headers. A node that cannot be
        reached or answers 503 did not take the request: it is taken out and another is tried."""
        tried: set[str] = set()
        while True:
            node = self.table.choose(model, exclude=tried)
            if node is None:
                raise self.unavailable(model)
            tried.add(node.url)
            dispatch = self.table.begin(node)
            try:
                upstream = await send(self.http, self.http.build_request("POST", node.url + path, content=body,
                                                                         headers=headers), self.first_byte_timeout_s)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self.table.finish(dispatch, completed=False)
                self._down(node, f"unreachable: {type(exc).__name__}")
                continue
            except httpx.HTTPError as exc:  # it took the request, which may have run: not sent elsewhere
                self.table.finish(dispatch, completed=False)
                raise self._failed(node, exc, "before answering") from None
            except BaseException:  # cancelled: the client went away
                self.table.finish(dispatch, completed=False)
                raise
            if upstream.status_code == 503:
                await upstream.aclose()
                self.table.finish(dispatch, completed=False)
                self._down(node, "answered 503")
                continue
            self.table.answered(node)
            return upstream, dispatch

    def _down(self, node: Node, reason: str) -> None:
        logger.warning("node %s %s: not routing to it until its /health passes", node.url, reason)
        self.table.mark_down(node, reason)

    def _failed(self, node: Node, exc: Exception, when: str) -> RequestError:
        """Take out a node that failed or timed out after taking a request; the client's error."""
        if isinstance(exc, httpx.TimeoutException):
            seconds = self.table.quarantine(node, f"timed out {when} ({exc})")
            logger.warning("node %s timed out %s (%s): not routing to it for %.0fs, whatever its /health says",
                           node.url, when, exc, seconds)
        else:
            self._down(node, f"broke off {when}: {type(exc).__name__}")
        return node_error(node.url, exc)

    async def forward(self, request: Request, path: str) -> Response:
        """One OpenAI request, passed to a node and its answer back."""
        body = await request.body()
        model, stream = _peek(body)
        if model is not None and self.table.up() and not self.table.serves(model):  # none up: 503 below
            served = sorted({m for n in self.table.nodes.values() for m in n.models})
            raise RequestError(404, f"the model `{model}` is not served by any api_server behind this proxy "
                               f"(served: {served}; see GET /v1/models)", param="model", code="model_not_found")
        headers = request_headers(request.headers)
        upstream, dispatch = await until_disconnected(request, self.open(path, body, headers, model))
        node = dispatch.node
        if stream and upstream.status_code == 200 and is_event_stream(upstream):
            return self._relay(upstream, dispatch, lambda on_end: relay_events(
                upstream, node.url, on_end, chunk_timeout_s=self.chunk_timeout_s))
        pieces = paced(upstream, self.chunk_timeout_s)
        completed = handed_over = False
        try:
            head, more = await until_disconnected(request, read_head(pieces, self.whole_answer_cap))
            if more:  # too large to hold: the rest is passed on as it comes
                handed_over = True
                return self._relay(upstream, dispatch, lambda on_end: pass_through(head, pieces, node.url, on_end),
                                   status_code=upstream.status_code)
            completed = upstream.status_code == 200
            return whole(upstream, head)
        except httpx.HTTPError as exc:
            raise self._failed(node, exc, "mid-answer") from None
        finally:
            if not handed_over:
                self.table.finish(dispatch, completed)
                await pieces.aclose()
                await upstream.aclose()

    def _relay(self, upstream: httpx.Response, dispatch: Dispatch,
               body: Callable[[Callable[[bool, Exception | None], None]], AsyncIterator[bytes]],
               status_code: int = 200) -> Response:
        """A response passing on ``body(on_end)``, the node's answer as it arrives; the request is
        counted out (completed if the node's answer was a 200 that ended well), and a node that
        failed taken out, when it ends however it ends."""
        node, ended = dispatch.node, False

        def on_end(completed: bool, error: Exception | None) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.table.finish(dispatch, completed and status_code == 200)
            if error is not None:
                self._failed(node, error, "mid-stream")

        async def cleanup() -> None:  # runs however the response ends, even before it started
            on_end(False, None)
            await upstream.aclose()

        return ClosingStreamingResponse(body(on_end), cleanup, status_code=status_code,
                                        headers=response_headers(upstream))

    async def add(self, node: NodeIn) -> Node:
        """Register a node: its models from ``status`` or its /v1/models, then one health check."""
        url = _node_url(node.url)
        status = node.status or NodeStatusIn()
        models, cards = list(status.models), {}
        if not models:
            auth = {"Authorization": f"Bearer {self.node_key}"} if self.node_key else {}
            try:
                answer = await self.http.get(f"{url}/v1/models", headers=auth, timeout=health.HEALTH_TIMEOUT_S)
            except httpx.HTTPError as exc:
                raise RequestError(400, f"could not reach {url}/v1/models ({type(exc).__name__} {exc}): is the "
                                   "api_server running there? (or give status.models)", param="url",
                                   code="node_unreachable") from None
            if answer.status_code != 200:
                hint = (": it wants an API key; give the proxy the nodes' keys (--api-keys)"
                        if answer.status_code == 401 else "")
                raise RequestError(400, f"{url}/v1/models answered {answer.status_code}{hint} (or give "
                                   "status.models)", param="url", code="node_unreachable")
            cards = {c["id"]: c for c in answer.json().get("data", [])}
            models = list(cards)
        entry = self.table.add(Node(url, models, status.speed, cards))
        await health.check(self.table, entry, self.http)
        logger.info("node %s added: %s, %s", url, models, "healthy" if entry.healthy else entry.down_reason)
        return entry


def _api_path(path: str) -> bool:
    return path.startswith("/v1/")


def _status_path(path: str) -> bool:
    return path.rstrip("/") == STATUS_PATH


def build_proxy_app(strategy: Strategy | str = Strategy.MIN_EXPECTED_LATENCY, *, api_keys: list[str] | None = None,
                    admin_keys: list[str] | None = None, health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
                    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S,
                    chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT_S, quarantine_s: float = QUARANTINE_S,
                    whole_answer_cap: int = WHOLE_ANSWER_CAP) -> FastAPI:
    """The proxy app; nodes join through ``POST /nodes/add`` (``api_server --proxy-url`` does it),
    with an admin key or, without ``admin_keys``, from this host. ``first_byte_timeout_s`` and
    ``chunk_timeout_s`` bound the waits on a node (``relay.py``), ``quarantine_s`` keeps out a node
    that timed out (doubling per timeout), ``whole_answer_cap`` bytes of an answer are held whole."""
    check_keys(api_keys, admin_keys)
    for name, value in (("first_byte_timeout_s", first_byte_timeout_s), ("chunk_timeout_s", chunk_timeout_s),
                        ("quarantine_s", quarantine_s)):
        if not value > 0:
            raise ValueError(f"{name}={value}: must be > 0 seconds")
    table = NodeTable(Strategy(strategy), quarantine_s=quarantine_s)
    proxy = _Proxy(table, api_keys[0] if api_keys else None, first_byte_timeout_s, chunk_timeout_s, whole_answer_cap)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.create_task(health.poll_forever(table, proxy.http, health_interval_s))
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await proxy.http.aclose()

    app = FastAPI(title="conveyor proxy", summary="distributes OpenAI requests over api_servers",
                  version="0.1.0", lifespan=lifespan)
    app.state.proxy = proxy
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=DEFAULT_MAX_BODY_BYTES)  # the body is held in memory to forward it
    if api_keys:
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys), guarded=_api_path)
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys) + list(admin_keys or ()), guarded=_status_path)
    app.add_middleware(AdminGuard, admin_keys=admin_keys, api_keys=api_keys)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/docs")

    @app.get("/health")
    async def health_route() -> Response:
        """200 while at least one node is up; 503 otherwise."""
        if not table.up():
            return error_response(503, proxy.unavailable(None).message, type="service_unavailable",
                                  code="no_node_available", headers={"Retry-After": str(RETRY_AFTER_S)})
        return Response(json.dumps({"status": "ok", "nodes_up": len(table.up())}), media_type="application/json")

    @app.get("/nodes/status")
    async def nodes_status() -> dict[str, Any]:
        """Every node: models, requests in flight (``unfinished``), recent latencies, speed, health,
        timeouts since it last served a request in full."""
        return table.status()

    @app.post("/nodes/add")
    async def nodes_add(node: NodeIn) -> str:
        """Add a node (or update one); without ``status.models`` its /v1/models is asked. Takes an
        admin key, or without ``--admin-keys`` a request from the proxy's host."""
        await proxy.add(node)
        return ADDED

    @app.post("/nodes/remove")
    async def nodes_remove(request: Request, node_url: str | None = None) -> str:
        """Remove a node: ``{"url": ...}`` in the body, or ``?node_url=`` (LMDeploy's older form). Takes
        an admin key, or without ``--admin-keys`` a request from the proxy's host."""
        raw = await request.body()
        if raw.strip():
            try:
                node_url = NodeIn.model_validate_json(raw).url
            except ValueError as exc:
                raise RequestError(400, f'the body must be {{"url": "http://HOST:PORT"}}: {exc}', param="url") \
                    from None
        if not node_url:
            raise RequestError(400, 'name the node: {"url": "http://HOST:PORT"} or ?node_url=', param="url")
        url = _node_url(node_url)
        if not table.remove(url):
            raise RequestError(404, f"no node {url} (GET /nodes/status lists them)", param="url",
                               code="node_not_found")
        logger.info("node %s removed", url)
        return DELETED

    @app.get("/v1/models")
    async def models() -> Response:
        """The models the nodes that are up serve."""
        return Response(json.dumps({"object": "list", "data": table.model_cards()}), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """One model by its id, if a node that is up serves it; 404 otherwise."""
        card = next((c for c in table.model_cards() if c["id"] == model_id), None)
        if card is None:
            raise RequestError(404, f"the model `{model_id}` is not served by any api_server that is up "
                               "(see GET /v1/models)", param="model", code="model_not_found")
        return Response(json.dumps(card), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions on a node the strategy picks (``stream`` relayed as it comes)."""
        return await proxy.forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions on a node the strategy picks (``stream`` relayed as it comes)."""
        return await proxy.forward(request, "/v1/completions")

    @app.post("/v1/chat/interactive", include_in_schema=False)
    async def interactive() -> Response:
        raise RequestError(400, "the proxy does not route /v1/chat/interactive: a session's history lives in one "
                           "api_server; send its turns to a node directly (GET /nodes/status lists them)",
                           code="not_supported_by_proxy")

    return app

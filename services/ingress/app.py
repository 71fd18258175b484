"""The HTTP ingress: an OpenAI-compatible FastAPI app in front of an EngineClient.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions,
POST /v1/chat/interactive (LMDeploy's stateful chat), GET /health, GET /metrics, /openapi.json,
and /docs and /redoc served with their scripts from the package (``docs.py``: no CDN). Every
request is counted in /metrics and logged on ``conveyor.access`` (``metrics.RequestCounter``).

Every error body is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` and
invalid parameters are 400, never FastAPI's 422. API keys, when set, guard /v1/* and /metrics;
/health stays open for load balancers and probes, /docs and /openapi.json stay open because they
describe the API without touching the model.

Limits (``limits.py``): a request's prompt characters, prompts and engine requests are capped
before anything is tokenized (400); past ``max_queued`` engine requests in flight a request gets
429 with Retry-After; a request running past ``request_timeout_s`` is aborted (504, or an error
event in a stream); slow headers close the connection, a slow body gets 408. With a QoS config
(``qos.py``) each request's ``user`` gives its engine priority, and a user over its quota gets 429.

A request whose HTTP client goes away is aborted in the engine: a stream when its response ends
(``ClosingStreamingResponse``), a non-streamed request through a watcher on the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ...protocol import GenerateReq, InvalidRequestError, LoadReport, error_code
from ..engine_client import RETRY_AFTER_S, RequestError, RequestOutput
from .limits import IngressLimits
from .qos import Admission, QosConfig, QosGate
from .docs import install_docs
from .metrics import CONTENT_TYPE, IngressMetrics, RequestCounter
from .openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    InteractiveRequest,
    InteractiveResponse,
    ModelCard,
    ModelList,
    describe_validation_error,
    error_envelope,
)
from .sse import (
    ChatFormat,
    ClientDisconnected,
    ClosingStreamingResponse,
    CompletionFormat,
    InteractiveFormat,
    LogprobRenderer,
    ResponseFormat,
    collect,
    first_event,
    iter_choices,
    stream_body,
    until_disconnected,
    usage_dict,
)

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse}
                                            for s in (400, 401, 404, 408, 413, 429, 503, 504)}
INTERACTIVE_MAX_NEW_TOKENS = 512  # /v1/chat/interactive's request_output_len default, as LMDeploy's
_STREAMED = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE with stream: true"}}
_LINES = {200: {"content": {"application/x-ndjson": {}}, "description": "JSON, or JSON lines with stream: true"}}


class EngineClientLike(Protocol):
    """What the ingress needs from ``services.engine_client.EngineClient``."""

    model_name: str
    session_len: int
    reply_to: str

    def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]: ...
    async def cancel_session(self, session_id: int) -> None: ...
    async def end_session(self, session_id: int) -> None: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def load(self) -> LoadReport | None: ...
    @property
    def down(self) -> list[str]: ...
    @property
    def serving_blocked_by(self) -> list[str]: ...


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    """An error in OpenAI's envelope."""
    return Response(_encode(error_envelope(status, message, type, param, code)), status_code=status,
                    headers=headers, media_type="application/json")


def _json(obj: Any) -> Response:
    return Response(_encode(obj), media_type="application/json")


# ---- middleware --------------------------------------------------------------------------------

def _guarded(path: str) -> bool:
    return path.startswith("/v1/") or path == "/metrics"


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
    ``guarded`` names (the ingress: /v1/* and /metrics)."""

    def __init__(self, app: Any, api_keys: list[str], guarded: Callable[[str], bool] = _guarded):
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


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, by Content-Length and by bytes really received.

    The body is read here in full (a chunked body has no Content-Length, and a client may send
    more than it announced) and replayed to the app; JSON bodies are read whole anyway.
    """

    def __init__(self, app: Any, max_bytes: int, timeout_s: float = 30.0):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, total = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:  # a client dripping its body must not hold a task and a socket
                await error_response(408, f"the request body did not arrive within {self.timeout_s:g}s",
                                     code="request_timeout", headers={"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nobody to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        await error_response(413, f"the request body exceeds {self.max_bytes} bytes",
                             code="request_too_large")(scope, receive, send)


# ---- errors ------------------------------------------------------------------------------------

def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's envelope: invalid bodies 400 (not 422), unknown routes 404,
    ``RequestError`` with its status, anything unexpected 500 (the proxy's app shares them)."""
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param=param)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        status, code = exc.status_code, None
        if status == 404:
            message, code = f"no route {request.method} {request.url.path}: see /docs", "not_found"
        elif status == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message = str(exc.detail)
        return error_response(status, message, code=code, headers=getattr(exc, "headers", None))

    async def failed(request: Request, exc: RequestError) -> Response:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, headers=headers)

    async def refused(request: Request, exc: InvalidRequestError) -> Response:  # a body's parameters
        return error_response(400, str(exc), param=exc.param, code=error_code(exc))

    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        return error_response(499, "the client closed the connection", code="client_closed_request")

    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", code="internal_error")

    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestError, failed)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidRequestError, refused)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, gone)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)


# ---- the request flow --------------------------------------------------------------------------

class _Ingress:
    """Per-app state, and the request flow the generation routes share."""

    def __init__(self, app: FastAPI, client: EngineClientLike, model_name: str, tokenizer: Any | None,
                 limits: IngressLimits, qos: QosGate | None = None):
        self.app, self.client, self.model_name, self.tokenizer = app, client, model_name, tokenizer
        self.limits, self.qos = limits, qos
        self.inflight = 0  # HTTP generation requests being served
        self.sequences = 0  # engine requests they made (n x prompts each)
        self.metrics = IngressMetrics(client, lambda: self.inflight)
        self.renderer = LogprobRenderer(tokenizer)

    def admit(self, model: str | None) -> None:
        """Raise unless a new generation request can be taken."""
        if model is not None and model != self.model_name:
            raise RequestError(404, f"the model `{model}` does not exist: this server serves "
                               f"`{self.model_name}` (see GET /v1/models)", param="model", code="model_not_found")
        if self.app.state.draining:
            raise RequestError(503, "the server is shutting down: retry on another replica",
                               type="service_unavailable", code="draining", retry_after=RETRY_AFTER_S)
        if not self.client.healthy:
            raise RequestError(503, "the engine is not answering: retry later",
                               type="service_unavailable", code="engine_unavailable", retry_after=RETRY_AFTER_S)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 before tokenizing a prompt longer than the character cap (tokenizing costs the
        tokenizer worker time and memory in proportion, whatever the token count turns out to be)."""
        cap = self.limits.prompt_chars_cap(self.client.session_len)
        if chars > cap:
            raise RequestError(400, f"the prompt has {chars} characters; this server takes at most {cap} "
                               f"(its context is {self.client.session_len} tokens)", param=param,
                               code="prompt_too_long")

    def _reserve(self, num: int, n: int, user: str | None) -> Admission | None:
        """Count ``num`` engine requests in, or refuse them: too many for one request (400), the
        ingress's queue full or ``user`` over its QoS quota (429; places come back as requests end)."""
        if num > self.limits.max_sequences:
            raise RequestError(400, f"this request makes {num} generations (n={n} for each prompt); this server "
                               f"takes at most {self.limits.max_sequences} per request", param="n",
                               code="too_many_choices")
        if num > self.limits.max_queued:  # would wait for places that never come: 429's "retry later" is false
            raise RequestError(400, f"this request makes {num} generations (n={n} for each prompt) but this server "
                               f"queues at most {self.limits.max_queued} (--max-queued-requests): lower n or send "
                               "fewer prompts", param="n", code="too_many_choices")
        if self.sequences + num > self.limits.max_queued:
            raise RequestError(429, f"the server has {self.sequences} generations queued or running, its limit: "
                               "retry later", type="rate_limit_exceeded", code="rate_limit_exceeded",
                               retry_after=RETRY_AFTER_S)
        admission = self.qos.admit(user, num) if self.qos is not None else None
        self.sequences += num
        self.inflight += 1
        return admission

    async def respond(self, request: Request, reqs: list[GenerateReq], fmt: ResponseFormat, *, stream: bool,
                      n: int, start: float, user: str | None = None) -> Response:
        """Run ``reqs`` (n choices per prompt) for ``user`` and answer with ``fmt``, streamed or whole."""
        admission = self._reserve(len(reqs), n, user)
        if admission is not None:
            for req in reqs:
                req.priority = admission.priority
        stats = [self.metrics.track(start) for _ in reqs]
        events = iter_choices(self.client, reqs, stats)

        async def finish() -> None:
            try:
                await events.aclose()
            finally:
                self.inflight -= 1
                self.sequences -= len(reqs)
                if admission is not None:
                    self.qos.release(admission)
                self.metrics.e2e.observe(time.perf_counter() - start)

        handed_off = False
        try:
            if stream:
                # Wait for the first output before answering, so that a request the tokenizer
                # refuses (prompt too long, ...) gets its 400 status rather than a 200 stream.
                first = await until_disconnected(request, first_event(events))
                body = stream_body(first, events, fmt, lambda: usage_dict(stats, n))
                response = ClosingStreamingResponse(body, finish, media_type=fmt.media_type,
                                                    headers=_STREAM_HEADERS)
                handed_off = True
                return response
            await until_disconnected(request, collect(events, fmt))
            return _json(fmt.body(usage_dict(stats, n)))
        finally:
            if not handed_off:
                with anyio.CancelScope(shield=True):
                    await finish()

    @staticmethod
    def new_session_id() -> int:
        """A random session id, far from the small ids users pick, and exact in JSON doubles
        (sessions live in the engine; a collision among 2**53 ids is not a practical worry)."""
        return 2**32 + secrets.randbelow(2**53 - 2**32)


def _rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- the app -----------------------------------------------------------------------------------

def build_app(client: EngineClientLike, *, api_keys: list[str] | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, served_model_name: str | None = None,
              tokenizer: Any | None = None, limits: IngressLimits | None = None,
              qos: QosConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``client``'s model.

    ``served_model_name`` is the name clients use (default: ``client.model_name``); ``tokenizer``
    (a transformers tokenizer) renders logprob tokens as text and enables ``echo`` of token-id
    prompts; without it tokens are shown as their ids. ``qos``: the user groups (``qos.py``).
    """
    app = FastAPI(title="conveyor", summary="OpenAI-compatible LLM server", version="0.1.0",
                  docs_url=None, redoc_url=None)  # install_docs serves them without a CDN
    install_docs(app)
    app.state.draining = False
    limits = limits or IngressLimits()
    gate = QosGate(qos, limits.max_queued) if qos is not None and qos.enabled else None
    if qos is not None and gate is None:
        logger.info("the QoS config has enable_user_qos false: every user is served alike")
    app.state.ingress = ing = _Ingress(app, client, served_model_name or client.model_name, tokenizer, limits, gate)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=limits.body_timeout_s)
    if api_keys:
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys))
    app.add_middleware(RequestCounter, metrics=ing.metrics)  # outermost: counts 401s and 413s too

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        """A browser that opens the server's address lands on the API's docs."""
        from fastapi.responses import RedirectResponse

        return RedirectResponse("/docs")

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine answers and the server is not draining; 503 otherwise."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if app.state.draining:
            return error_response(503, "the server is shutting down", code="draining", headers=retry)
        blocked = client.serving_blocked_by
        if blocked:
            return error_response(503, f"stage(s) restarting: {', '.join(blocked)}", code="stage_down", headers=retry)
        if not client.healthy:
            return error_response(503, "the engine is not answering", code="engine_unavailable", headers=retry)
        # One of several tokenizer workers restarting: the others serve, so a proxy keeps routing here.
        return _json({"status": "ok", **({"restarting": client.down} if client.down else {})})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(ing.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        name = ing.model_name
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "conveyor", "root": name,
                "parent": None, "max_model_len": client.session_len, "permission": []}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> Response:
        """The served model."""
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> Response:
        """One model by its id (ids may hold slashes: ``org/name``); 404 for one not served."""
        if model_id != ing.model_name:
            raise RequestError(404, f"the model `{model_id}` does not exist: this server serves "
                               f"`{ing.model_name}`", param="model", code="model_not_found")
        return _json(model_card())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions (set ``stream`` for server-sent events)."""
        start = time.perf_counter()
        ing.admit(body.model)
        rid, n, k = _rid("chatcmpl"), body.num_choices, body.num_logprobs
        messages = [m.to_wire() for m in body.messages]
        ing.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        max_new = body.requested_max_tokens or client.session_len  # the tokenizer caps it to what fits
        reqs = [GenerateReq(rid=f"{rid}-{i}", reply_to=client.reply_to, messages=messages,
                            params=body.sampling_params(max_new, k, i)) for i in range(n)]
        fmt = ChatFormat(rid, int(time.time()), ing.model_name, n, ing.renderer, k, body.wants_usage_chunk)
        return await ing.respond(request, reqs, fmt, stream=bool(body.stream), n=n, start=start, user=body.user)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, **_STREAMED})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) text completions: no chat template; a batch of prompts gives n choices each."""
        start = time.perf_counter()
        ing.admit(body.model)
        if body.echo and body.logprobs is not None:  # OpenAI's answer would carry the prompt's logprobs too
            raise RequestError(400, "echo with logprobs: the prompt's logprobs are not computed; send echo or "
                               "logprobs, not both", param="echo")
        if body.suffix:
            raise RequestError(400, "suffix: text insertion is not supported; send null", param="suffix")
        rid, n, prompts = _rid("cmpl"), body.num_choices, body.prompts
        if len(prompts) > limits.max_prompts:
            raise RequestError(400, f"{len(prompts)} prompts in one request; this server takes at most "
                               f"{limits.max_prompts}: split the batch", param="prompt", code="too_many_prompts")
        ing.check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        echo: list[str] | None = None
        if body.echo:
            if tokenizer is None and any(isinstance(p, list) for p in prompts):
                raise RequestError(400, "echo of a token-id prompt needs the server's tokenizer: send text",
                                   param="echo")
            try:
                texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
            except Exception as exc:  # noqa: BLE001 - ids outside the vocabulary
                raise RequestError(400, f"the prompt's token ids do not decode: {exc}", param="prompt") from exc
            echo = [t for t in texts for _ in range(n)]
        max_new = body.max_tokens or client.session_len
        reqs = [GenerateReq(rid=f"{rid}-{j * n + i}", reply_to=client.reply_to, do_preprocess=False,
                            prompt=p if isinstance(p, str) else None, input_ids=None if isinstance(p, str) else p,
                            params=body.sampling_params(max_new, body.logprobs, i))
                for j, p in enumerate(prompts) for i in range(n)]
        fmt = CompletionFormat(rid, int(time.time()), ing.model_name, len(reqs), ing.renderer, body.logprobs,
                               body.wants_usage_chunk, echo=echo)
        return await ing.respond(request, reqs, fmt, stream=bool(body.stream), n=n, start=start, user=body.user)

    @app.post("/v1/chat/interactive", response_model=InteractiveResponse, responses={**_ERRORS, **_LINES})
    async def chat_interactive(body: InteractiveRequest, request: Request) -> Response:
        """LMDeploy's stateful chat: with ``interactive_mode`` the server keeps the session's history.

        ``interactive_mode: false`` ends the session (if open) and answers the prompt statelessly;
        ``cancel`` aborts the session's running turn; ``end`` (extension) only ends the session.
        Streamed as one JSON object per line.
        """
        start = time.perf_counter()
        sid = body.session_id
        if body.cancel:
            if sid == -1:
                raise RequestError(400, "cancel needs the session_id of the turn to cancel", param="session_id")
            await client.cancel_session(sid)
            return _json({"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
                          "finish_reason": "stop", "session_id": sid})
        if (body.end or not body.interactive_mode) and sid != -1:
            await client.end_session(sid)
        if body.end:
            return _json({"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
                          "finish_reason": None, "session_id": sid})
        ing.admit(None)
        if not body.prompt:
            raise RequestError(400, "the prompt is empty: give some text or messages", param="prompt")
        prompt, messages = (body.prompt, None) if isinstance(body.prompt, str) else \
            (None, [m.to_wire() for m in body.prompt])
        ing.check_prompt_chars(len(prompt) if prompt else sum(len(m["content"]) for m in messages or []), "prompt")
        session_id = None
        if body.interactive_mode:  # the engine keeps the session; it knows whether this is a first turn
            session_id = sid if sid != -1 else ing.new_session_id()
        req = GenerateReq(rid=_rid("interactive"), reply_to=client.reply_to, prompt=prompt, messages=messages,
                          session_id=session_id, sequence_start=None if body.interactive_mode else True,
                          params=body.sampling_params(body.request_output_len or INTERACTIVE_MAX_NEW_TOKENS))
        fmt = InteractiveFormat(session_id)
        return await ing.respond(request, [req], fmt, stream=body.stream, n=1, start=start, user=body.user_id)

    return app


def begin_drain(app: FastAPI) -> None:
    """Refuse new generation requests (503) and fail /health; requests in flight run to the end."""
    app.state.draining = True
    logger.info("draining: %d requests in flight", inflight_requests(app))


def inflight_requests(app: FastAPI) -> int:
    """Generation requests this app is serving now (a launcher waits for 0 before stopping)."""
    return app.state.ingress.inflight

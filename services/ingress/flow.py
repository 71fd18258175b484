"""The ingress's per-app state and the request flow every generation route shares: admit a
request (its model, the served one or a LoRA adapter; draining; engine health), check its prompt
size, reserve queue places (and a QoS quota), run its engine requests and answer, streamed or whole.

A request whose HTTP client goes away is aborted in the engine: a stream when its response ends
(``ClosingStreamingResponse``), a non-streamed request through a watcher on the connection.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from ...protocol import GenerateReq, LoadReport, SamplingParams
from ..engine_client import RETRY_AFTER_S, RequestError, RequestOutput
from ..http import ClosingStreamingResponse, ErrorResponse, until_disconnected
from .limits import IngressLimits
from .metrics import IngressMetrics
from .qos import Admission, QosGate
from .sse import LogprobRenderer, ResponseFormat, collect, first_event, iter_choices, stream_body, usage_dict
from .tool_calling import ChatParsing

_encode = msgspec.json.Encoder().encode
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering
# The error statuses a route may answer, for /openapi.json.
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse}
                                           for s in (400, 401, 404, 408, 413, 429, 503, 504)}


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
    # LoRA adapters (``EngineClient``): the engine's, name -> checkpoint path where known; a
    # client without them (a test's stand-in) serves the base model only.
    adapters: dict[str, str | None]
    async def load_adapter(self, name: str, path: str) -> list[str]: ...
    async def unload_adapter(self, name: str) -> list[str]: ...


def json_response(obj: Any) -> Response:
    """``obj`` as a JSON response."""
    return Response(_encode(obj), media_type="application/json")


def with_adapter(params: SamplingParams, adapter: str | None) -> SamplingParams:
    """``params`` running with the LoRA adapter ``adapter`` (None: unchanged, the base model)."""
    return params if adapter is None else msgspec.structs.replace(params, adapter_name=adapter)


def request_id(prefix: str) -> str:
    """A new request id, OpenAI-style (``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class Ingress:
    """Per-app state, and the request flow the generation routes share."""

    def __init__(self, app: FastAPI, client: EngineClientLike, model_name: str, tokenizer: Any | None,
                 limits: IngressLimits, qos: QosGate | None = None, chat: ChatParsing | None = None):
        self.app, self.client, self.model_name, self.tokenizer = app, client, model_name, tokenizer
        self.limits, self.qos = limits, qos
        self.chat = chat or ChatParsing()  # the chat route's tool-call and reasoning parsers
        self.inflight = 0  # HTTP generation requests being served
        self.sequences = 0  # engine requests they made (n x prompts each)
        self.metrics = IngressMetrics(client, lambda: self.inflight)
        self.renderer = LogprobRenderer(tokenizer)

    @property
    def adapters(self) -> dict[str, str | None]:
        """The engine's LoRA adapters as the client last heard (name -> checkpoint path, or None)."""
        return getattr(self.client, "adapters", None) or {}

    def admit(self, model: str | None, adapter_name: str | None = None) -> str | None:
        """Raise unless a new generation request can be taken; returns the LoRA adapter it runs
        with (None: the base model)."""
        adapter = self.resolve_adapter(model, adapter_name)
        if self.app.state.draining:
            raise RequestError(503, "the server is shutting down: retry on another replica",
                               type="service_unavailable", code="draining", retry_after=RETRY_AFTER_S)
        if not self.client.healthy:
            raise RequestError(503, "the engine is not answering: retry later",
                               type="service_unavailable", code="engine_unavailable", retry_after=RETRY_AFTER_S)
        return adapter

    def resolve_adapter(self, model: str | None, adapter_name: str | None) -> str | None:
        """The LoRA adapter a request names: ``model`` when it is an adapter's name (vLLM's way),
        or LMDeploy's ``adapter_name``; None for the served model. 404 for a name not served, 400
        when the two name different adapters."""
        adapters = self.adapters
        by_model = None
        if model is not None and model != self.model_name:
            if model not in adapters:
                raise self.unknown_model(model, "model")
            by_model = model
        if adapter_name is None:
            return by_model
        if adapter_name not in adapters:
            raise self.unknown_model(adapter_name, "adapter_name")
        if by_model is not None and by_model != adapter_name:
            raise RequestError(400, f"model `{model}` and adapter_name `{adapter_name}` name two different LoRA "
                               "adapters: name the adapter once (model alone is enough)", param="adapter_name")
        return adapter_name

    def unknown_model(self, name: str, param: str = "model") -> RequestError:
        """The 404 for a model name this server does not serve, listing those it does."""
        names = ", ".join(f"`{n}`" for n in self.adapters)
        also = f" and the LoRA adapter(s) {names}" if names else ""
        return RequestError(404, f"the model `{name}` does not exist: this server serves `{self.model_name}`{also} "
                            "(see GET /v1/models)", param=param, code="model_not_found")

    def check_message_chars(self, messages: list[dict[str, Any]], extra: int = 0) -> None:
        """``check_prompt_chars`` of a chat: its text (images are held to their own limits, in
        the tokenizer stage), plus ``extra`` characters rendered with it (tools)."""
        chars = sum(len(c) if isinstance(c := m.get("content") or "", str)
                    else sum(len(p.get("text", "")) for p in c) for m in messages)
        self.check_prompt_chars(chars + extra, "messages")

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
            return json_response(fmt.body(usage_dict(stats, n)))
        finally:
            if not handed_off:
                with anyio.CancelScope(shield=True):
                    await finish()

    @staticmethod
    def new_session_id() -> int:
        """A random session id, far from the small ids users pick, and exact in JSON doubles
        (sessions live in the engine; a collision among 2**53 ids is not a practical worry)."""
        return 2**32 + secrets.randbelow(2**53 - 2**32)

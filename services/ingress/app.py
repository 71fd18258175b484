"""The HTTP ingress: an OpenAI-compatible FastAPI app in front of an EngineClient.

Routes (``routes/``): GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
(``status.py``); POST /v1/completions, POST /v1/chat/completions (``completions.py``); POST
/v1/chat/interactive, LMDeploy's stateful chat (``interactive.py``); POST /v1/load_lora_adapter
and POST /v1/unload_lora_adapter, vLLM's LoRA adapter routes (``adapters.py``); /openapi.json, and /docs
and /redoc served with their scripts from the package (``docs.py``: no CDN). Every request is
counted in /metrics and logged on ``conveyor.access`` (``metrics.RequestCounter``). The request
flow the generation routes share is ``flow.py``.

Every error body is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` and
invalid parameters are 400, never FastAPI's 422 (``services/http``, shared with the proxy). API
keys, when set, guard /v1/* and /metrics; /health stays open for load balancers and probes,
/docs and /openapi.json stay open because they describe the API without touching the model.

Limits (``limits.py``): a request's prompt characters, prompts and engine requests are capped
before anything is tokenized (400); past ``max_queued`` engine requests in flight a request gets
429 with Retry-After; a request running past ``request_timeout_s`` is aborted (504, or an error
event in a stream); slow headers close the connection, a slow body gets 408. With a QoS config
(``qos.py``) each request's ``user`` gives its engine priority, and a user over its quota gets 429.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI

from ..http import ApiKeyGuard, BodyLimit, install_error_handlers
from .docs import install_docs
from .flow import EngineClientLike, Ingress
from .limits import IngressLimits
from .metrics import RequestCounter
from .qos import QosConfig, QosGate
from .routes import install_adapters, install_completions, install_interactive, install_status
from .tool_calling import ChatParsing

logger = logging.getLogger(__name__)


def _guarded(path: str) -> bool:
    """The paths an API key opens: the API and the metrics."""
    return path.startswith("/v1/") or path == "/metrics"


def build_app(client: EngineClientLike, *, api_keys: list[str] | None = None,
              max_body_bytes: int | None = None, served_model_name: str | None = None,
              tokenizer: Any | None = None, limits: IngressLimits | None = None,
              qos: QosConfig | None = None, chat: ChatParsing | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``client``'s model.

    ``served_model_name`` is the name clients use (default: ``client.model_name``); ``tokenizer``
    (a transformers tokenizer) renders logprob tokens as text and enables ``echo`` of token-id
    prompts; without it tokens are shown as their ids. ``qos``: the user groups (``qos.py``).
    ``chat``: the tool-call and reasoning parsers of the chat route (``tool_calling.py``).
    """
    app = FastAPI(title="conveyor", summary="OpenAI-compatible LLM server", version="0.1.0",
                  docs_url=None, redoc_url=None)  # install_docs serves them without a CDN
    install_docs(app)
    app.state.draining = False
    limits = limits or IngressLimits()
    gate = QosGate(qos, limits.max_queued) if qos is not None and qos.enabled else None
    if qos is not None and gate is None:
        logger.info("the QoS config has enable_user_qos false: every user is served alike")
    app.state.ingress = ing = Ingress(app, client, served_model_name or client.model_name, tokenizer, limits, gate,
                                      chat)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes or limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if api_keys:
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys), guarded=_guarded)
    app.add_middleware(RequestCounter, metrics=ing.metrics)  # outermost: counts 401s and 413s too
    install_status(app, ing)
    install_completions(app, ing)
    install_interactive(app, ing)
    install_adapters(app, ing)
    return app


def begin_drain(app: FastAPI) -> None:
    """Refuse new generation requests (503) and fail /health; requests in flight run to the end."""
    app.state.draining = True
    logger.info("draining: %d requests in flight", inflight_requests(app))


def inflight_requests(app: FastAPI) -> int:
    """Generation requests this app is serving now (a launcher waits for 0 before stopping)."""
    return app.state.ingress.inflight

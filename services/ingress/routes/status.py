"""The routes that describe the server rather than generate: ``/`` (to the docs), ``/health``,
``/metrics`` and the served model with its LoRA adapters (``/v1/models``, ``/v1/models/{id}``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.responses import Response

from ...engine_client import RETRY_AFTER_S
from ...http import ErrorResponse, error_response
from ..flow import ERRORS, Ingress, json_response
from ..metrics import CONTENT_TYPE
from ..openai_schemas import HealthResponse, ModelCard, ModelList


def install_status(app: FastAPI, ing: Ingress) -> None:
    """Add the routes of this module to ``app``."""
    client = ing.client

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        """A browser that opens the server's address lands on the API's docs."""
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
        return json_response({"status": "ok", **({"restarting": client.down} if client.down else {})})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(ing.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(created: int) -> dict[str, Any]:
        name = ing.model_name
        return {"id": name, "object": "model", "created": created, "owned_by": "conveyor", "root": name,
                "parent": None, "max_model_len": client.session_len, "permission": []}

    def adapter_card(name: str, path: str | None, created: int) -> dict[str, Any]:
        # vLLM's fields: the adapter's checkpoint as its root, the served model as its parent.
        return {"id": name, "object": "model", "created": created, "owned_by": "conveyor", "root": path,
                "parent": ing.model_name, "max_model_len": client.session_len, "permission": []}

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> Response:
        """The served model, then its LoRA adapters (``parent``: the served model)."""
        now = int(time.time())
        cards = [model_card(now)] + [adapter_card(name, path, now) for name, path in ing.adapters.items()]
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str) -> Response:
        """One model or LoRA adapter by its id (ids may hold slashes: ``org/name``); 404 for one not served."""
        now = int(time.time())
        if model_id == ing.model_name:
            return json_response(model_card(now))
        adapters = ing.adapters
        if model_id in adapters:
            return json_response(adapter_card(model_id, adapters[model_id], now))
        raise ing.unknown_model(model_id)

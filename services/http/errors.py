"""Errors over HTTP: OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}`` for
every error body, and the handlers that make a FastAPI app answer every failure with it
(invalid bodies 400, never FastAPI's 422). The ingress and the proxy install the same handlers,
so a client sees one shape of error whoever answers.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ...protocol import InvalidRequestError, error_code
from ..engine_client import RequestError
from .disconnect import ClientDisconnected
from .validation import describe_validation_error

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_ERROR_TYPES = {401: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


class ErrorDetail(BaseModel):
    """What went wrong."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response, as OpenAI's: ``{"error": {...}}``."""

    error: ErrorDetail


def error_envelope(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None) -> dict[str, Any]:
    """The ``{"error": {...}}`` body of an error; ``type`` defaults from the status."""
    kind = type or _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    """An error in OpenAI's envelope."""
    return Response(_encode(error_envelope(status, message, type, param, code)), status_code=status,
                    headers=headers, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's envelope: invalid bodies 400 (not 422), unknown routes 404,
    ``RequestError`` with its status, anything unexpected 500."""
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

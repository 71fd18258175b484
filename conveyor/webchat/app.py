"""The web chat's HTTP side: one self-contained page and a small JSON API over a ``ChatBackend``.

Each browser tab gets a token (``POST /api/sessions``) naming a server-side session; the page
sends one message per turn and reads the reply as NDJSON lines (``{"text", "tokens",
"finish_reason"}``), while cancel and reset are separate requests. Errors are OpenAI's envelope.

The page keeps its transcript in the browser across a reload, so the session must outlive the page
for a while: a page that goes away says so (``leave``), and the page that comes back asks for its
old token (``{"resume": token}``) and gets the session under a new token, which leaves the old one
useless to any other tab holding it. A tab left and not resumed within ``leave_grace_s`` is ended.

A turn's reply is read off the backend by a thread of its own (the backends block), which hands
pieces to the response through an asyncio queue and keeps reading after the browser goes away,
so that a session is only ever free for its next turn once the engine has ended the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, Response, StreamingResponse

from conveyor.api_client import APIConnectionError, APIError
from conveyor.messages import GenerationConfig
from conveyor.protocol import InvalidRequestError, error_code
from conveyor.protocol.sampling import INTERACTIVE_DEFAULTS
from conveyor.services.http import describe_validation_error, error_envelope, error_response

from .backends import ChatBackend, Piece

# The sampling fields a turn carries and the page shows (its inputs start at their defaults).
SETTING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty")

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 3600.0  # a tab silent this long (closed without saying so) has its session ended
LEAVE_GRACE_S = 60.0  # a page that left (a reload, or closed) has this long to come back to its session
# The page loads nothing from elsewhere (it must work offline); the policy makes that a rule.
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class TurnRequest(BaseModel):
    """POST /api/sessions/{token}/turns: the user's message and this turn's sampling settings
    (defaults: /v1/chat/interactive's, the api_server route a web chat of a server drives)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(INTERACTIVE_DEFAULTS.max_new_tokens, ge=1)
    temperature: float = INTERACTIVE_DEFAULTS.temperature
    top_p: float = INTERACTIVE_DEFAULTS.top_p
    top_k: int = INTERACTIVE_DEFAULTS.top_k
    repetition_penalty: float = INTERACTIVE_DEFAULTS.repetition_penalty

    def generation_config(self) -> GenerationConfig:
        """The settings as a GenerationConfig: checked here, so both backends refuse alike."""
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty)


class OpenRequest(BaseModel):
    """POST /api/sessions: optionally the token of the session a reloaded page wants back."""

    model_config = ConfigDict(extra="forbid")

    resume: str | None = None


class WebChatError(Exception):
    """A request the web chat refuses (an unknown tab, a turn while one streams)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Turn:
    """A reply being generated; ``session_id`` is the session it runs in (a reset moves the tab on)."""

    session_id: int
    stopping: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Tab:
    session_id: int
    last_used: float
    turn: _Turn | None = None
    left_at: float | None = None  # when its page said it went away; None while a page holds it

    @property
    def busy(self) -> bool:
        """A reply of the tab's current session is still being generated."""
        return self.turn is not None and not self.turn.done.is_set() and self.turn.session_id == self.session_id


def _line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


def _piece(p: Piece) -> dict[str, Any]:
    return {"text": p.text, "tokens": p.tokens, "finish_reason": p.finish_reason}


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param=param)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
        return error_response(exc.status_code, str(exc.detail))

    async def refused(request: Request, exc: WebChatError) -> Response:
        return error_response(exc.status, str(exc), code=exc.code)

    async def bad_settings(request: Request, exc: InvalidRequestError) -> Response:
        return error_response(400, str(exc), param=exc.param, code=error_code(exc))

    async def server_refused(request: Request, exc: APIError) -> Response:  # the api_server's envelope, passed on
        err = exc.body.get("error", {}) if isinstance(exc.body, dict) else {}
        return error_response(exc.status, err.get("message", str(exc)), err.get("type"), err.get("param"),
                              err.get("code"))

    async def unreachable(request: Request, exc: APIConnectionError) -> Response:
        return error_response(502, str(exc), code="api_server_unreachable")

    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(WebChatError, refused)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidRequestError, bad_settings)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, server_refused)  # type: ignore[arg-type]
    app.add_exception_handler(APIConnectionError, unreachable)  # type: ignore[arg-type]


class WebChat:
    """The tabs (token -> session) and the turns streaming in them."""

    def __init__(self, backend: ChatBackend, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 leave_grace_s: float = LEAVE_GRACE_S):
        self.backend = backend
        self.idle_timeout_s = idle_timeout_s
        self.leave_grace_s = leave_grace_s
        self.tabs: dict[str, _Tab] = {}

    def tab(self, token: str) -> _Tab:
        """The tab of ``token``, marked as used now; 404 if there is none."""
        tab = self.tabs.get(token)
        if tab is None:
            raise WebChatError(404, "no such chat session (it ended, or the server restarted): reload the page",
                               "session_not_found")
        tab.last_used = time.monotonic()
        return tab

    async def open(self, resume: str | None = None) -> tuple[str, bool]:
        """A token for a new tab: with ``resume``, that tab's session if the server still has it
        (the old token stops working), else a fresh session. Returns (token, resumed)."""
        await self.sweep()
        token = secrets.token_urlsafe(16)  # unguessable: a tab cannot reach another's conversation
        tab = self.tabs.pop(resume, None) if resume is not None else None
        if tab is not None:
            tab.left_at, tab.last_used = None, time.monotonic()
            self.tabs[token] = tab
            return token, True
        self.tabs[token] = _Tab(await run_in_threadpool(self.backend.open), time.monotonic())
        return token, False

    def leave(self, token: str) -> None:
        """The tab's page went away: its session ends unless a page resumes it within the grace time."""
        self.tab(token).left_at = time.monotonic()

    async def sweep(self) -> None:
        """End the sessions of tabs left and not resumed in time, or silent for too long."""
        now = time.monotonic()
        for token, tab in list(self.tabs.items()):
            gone = tab.left_at is not None and now - tab.left_at > self.leave_grace_s
            if (gone or now - tab.last_used > self.idle_timeout_s) and not tab.busy:
                try:
                    await self.end(token)
                except Exception:  # the api_server may be gone; the tab is forgotten anyway
                    logger.warning("could not end a chat session that was left", exc_info=True)

    async def turn(self, token: str, body: TurnRequest) -> AsyncIterator[bytes]:
        """Start a turn; returns its NDJSON lines once the first piece is in (or raises its error)."""
        tab = self.tab(token)
        if tab.busy:
            raise WebChatError(409, "a reply is still being generated in this chat: wait for it or cancel it",
                               "session_busy")
        gen = body.generation_config()
        turn = tab.turn = _Turn(tab.session_id)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()
        threading.Thread(target=self._read, args=(tab, turn, body.prompt, gen, loop, pieces),
                         name="webchat-turn", daemon=True).start()
        try:
            first = await pieces.get()
        except asyncio.CancelledError:  # the page went away before the reply began
            turn.stopping = True
            loop.run_in_executor(None, self._stop_quietly, turn.session_id)
            raise
        if isinstance(first, BaseException):
            raise first
        return self._relay(turn, first, pieces)

    def _read(self, tab: _Tab, turn: _Turn, prompt: str, gen: GenerationConfig, loop: asyncio.AbstractEventLoop,
              pieces: asyncio.Queue) -> None:
        """The turn's thread: every piece of the reply to ``pieces``, then None (or the error)."""
        def put(item: Piece | BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the server is shutting down: nobody reads any more
                pass

        try:
            for piece in self.backend.turn(turn.session_id, prompt, gen):
                if turn.stopping and piece.finish_reason is None:
                    # A stop that reached the engine before it took the turn stopped nothing: again.
                    self.backend.stop(turn.session_id)
                put(piece)
        except Exception as exc:  # noqa: BLE001 - reported to the page
            put(exc)
        finally:
            turn.done.set()
            tab.last_used = time.monotonic()
            put(None)

    async def _relay(self, turn: _Turn, first: Piece, pieces: asyncio.Queue) -> AsyncIterator[bytes]:
        item: Piece | BaseException | None = first
        try:
            while item is not None:
                if isinstance(item, BaseException):
                    yield _line(self._envelope(item))
                    return
                yield _line(_piece(item))
                item = await pieces.get()
        finally:
            if not turn.done.is_set():  # the page went away mid-reply: stop generating for nobody
                turn.stopping = True
                asyncio.get_running_loop().run_in_executor(None, self._stop_quietly, turn.session_id)

    def _stop_quietly(self, session_id: int) -> None:
        try:
            self.backend.stop(session_id)
        except Exception:  # the turn may have ended, or the api_server gone
            logger.debug("stopping session %d failed", session_id, exc_info=True)

    @staticmethod
    def _envelope(exc: BaseException) -> dict[str, Any]:
        if isinstance(exc, APIError) and isinstance(exc.body, dict) and "error" in exc.body:
            return exc.body
        if isinstance(exc, InvalidRequestError):
            return error_envelope(400, str(exc), param=exc.param, code=error_code(exc))
        if isinstance(exc, APIConnectionError):
            return error_envelope(502, str(exc), code="api_server_unreachable")
        logger.error("a turn failed", exc_info=exc)
        return error_envelope(500, f"the reply failed: {exc}", code="internal_error")

    async def cancel(self, token: str) -> bool:
        """Stop the tab's running reply (it ends with finish_reason 'abort'); False if none runs."""
        tab = self.tab(token)
        turn = tab.turn
        if not tab.busy or turn is None:
            return False
        turn.stopping = True
        await run_in_threadpool(self.backend.stop, turn.session_id)
        return True

    async def reset(self, token: str) -> None:
        """End the tab's session (stopping a running reply) and give the tab a fresh one."""
        tab = self.tab(token)
        old = tab.session_id
        if tab.turn is not None:
            tab.turn.stopping = True
        tab.session_id = await run_in_threadpool(self.backend.open)
        await run_in_threadpool(self.backend.end, old)

    async def end(self, token: str) -> None:
        """Forget the tab and end its session."""
        tab = self.tabs.pop(token, None)
        if tab is not None:
            if tab.turn is not None:
                tab.turn.stopping = True
            await run_in_threadpool(self.backend.end, tab.session_id)

    async def end_all(self) -> None:
        """End every tab's session (the web chat is stopping; an api_server would keep them)."""
        for token in list(self.tabs):
            try:
                await self.end(token)
            except Exception:  # the api_server may be gone already
                logger.warning("could not end a chat session on shutdown", exc_info=True)


def create_app(backend: ChatBackend, idle_timeout_s: float = IDLE_TIMEOUT_S, close_backend: bool = False,
               leave_grace_s: float = LEAVE_GRACE_S) -> FastAPI:
    """The web chat's FastAPI app over ``backend``. On shutdown it ends the tabs' sessions and,
    with ``close_backend``, closes the backend."""
    chat = WebChat(backend, idle_timeout_s, leave_grace_s)
    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    # The settings start at the interactive endpoint's defaults, written once in protocol/sampling.py.
    for name in SETTING_FIELDS:
        page = page.replace(f"%%{name}%%", f"{getattr(INTERACTIVE_DEFAULTS, name):g}")

    async def sweep_now_and_then() -> None:
        # A closed tab's session holds KV cache: end it soon after the grace time, not only when
        # another tab happens to open.
        while True:
            await asyncio.sleep(min(leave_grace_s, idle_timeout_s) / 2)
            await chat.sweep()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(sweep_now_and_then())
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        # Here, not after uvicorn.run returns: on SIGTERM uvicorn re-raises the signal once the
        # app has shut down, and the process ends there.
        await chat.end_all()
        if close_backend:
            await run_in_threadpool(backend.close)

    app = FastAPI(title="conveyor web chat", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.webchat = chat
    _install_error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> Response:
        return HTMLResponse(page, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store"})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/sessions")
    async def open_session(body: OpenRequest | None = None) -> dict[str, str | bool]:
        token, resumed = await chat.open(body.resume if body is not None else None)
        return {"session": token, "model": backend.model_name, "resumed": resumed}

    @app.post("/api/sessions/{token}/turns")
    async def turn(token: str, body: TurnRequest) -> Response:
        lines = await chat.turn(token, body)
        return StreamingResponse(lines, media_type="application/x-ndjson", headers={"Cache-Control": "no-store"})

    @app.post("/api/sessions/{token}/cancel")
    async def cancel(token: str) -> dict[str, bool]:
        return {"cancelled": await chat.cancel(token)}

    @app.post("/api/sessions/{token}/reset")
    async def reset(token: str) -> dict[str, str]:
        await chat.reset(token)
        return {"session": token}

    @app.post("/api/sessions/{token}/leave")  # POST: what navigator.sendBeacon sends as the page goes
    async def leave(token: str) -> dict[str, bool]:
        chat.leave(token)
        return {"left": True}

    @app.post("/api/sessions/{token}/end")
    async def end(token: str) -> dict[str, bool]:
        await chat.end(token)
        return {"ended": True}

    return app


def serve_webchat(backend: ChatBackend, server_name: str = "0.0.0.0", server_port: int = 6006,
                  log_level: str = "INFO") -> int:
    """Serve the web chat until interrupted (the backend is closed on the way out); returns the exit code."""
    import uvicorn

    uvicorn.run(create_app(backend, close_backend=True), host=server_name, port=server_port,
                log_level=log_level.lower())
    return 0

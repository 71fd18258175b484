"""Where the web chat's turns run: the engine in this process, or a running ``api_server``.

Both keep the conversation's history server-side as an interactive session (the engine keeps its
tokens and KV cache between turns), so the page sends only each new message. The methods are
blocking; the web app calls them from worker threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from conveyor.api_client import APIClient, new_session_id
from conveyor.messages import GenerationConfig

if TYPE_CHECKING:  # a web chat on an api_server does not load torch and the engine
    from conveyor.pipeline import Pipeline, Session


class Piece(NamedTuple):
    """One streamed increment of a reply: new text, tokens generated so far, and why it ended (last piece)."""

    text: str
    tokens: int
    finish_reason: str | None


class ChatBackend(Protocol):
    """What the web app needs: sessions, a streamed turn, stop (cancel) and end (reset)."""

    model_name: str

    def open(self) -> int:
        """Start a new, empty session; returns its id."""

    def turn(self, session_id: int, prompt: str, gen: GenerationConfig) -> Iterator[Piece]:
        """Send one user message; iterate to stream the reply (closing the iterator aborts it)."""

    def stop(self, session_id: int) -> None:
        """Stop the session's running turn; its stream then ends with finish_reason 'abort'."""

    def end(self, session_id: int) -> None:
        """Stop any running turn and forget the session's history (frees its KV cache)."""

    def close(self) -> None:
        """Release what the backend holds (the model, the HTTP connections)."""


class PipelineBackend:
    """Turns run on a ``Pipeline`` in this process, one pipeline ``Session`` per conversation."""

    def __init__(self, pipe: Pipeline, model_name: str | None = None):
        self.pipe = pipe
        self.model_name = model_name or Path(str(pipe.model_path)).name
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()

    def open(self) -> int:
        session = self.pipe.session()
        with self._lock:
            self._sessions[session.session_id] = session
        return session.session_id

    def turn(self, session_id: int, prompt: str, gen: GenerationConfig) -> Iterator[Piece]:
        stream = self.pipe.chat(prompt, session=self._sessions[session_id], gen_config=gen, stream_response=True)
        return (Piece(r.text, r.generate_token_len, r.finish_reason) for r in stream)

    def stop(self, session_id: int) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.stop()

    def end(self, session_id: int) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.close()

    def close(self) -> None:
        self.pipe.close()


class ApiServerBackend:
    """Turns go to a running ``conveyor serve api_server`` (or LMDeploy's) ``/v1/chat/interactive``."""

    def __init__(self, url: str, api_key: str | None = None):
        self.client = APIClient(url, api_key)
        models = self.client.available_models  # fails now, with the reason, if the server is not there
        self.model_name = models[0] if models else self.client.base

    def open(self) -> int:
        # Random: the server's sessions are shared by all its clients (other web chats, api_client).
        return new_session_id()

    def turn(self, session_id: int, prompt: str, gen: GenerationConfig) -> Iterator[Piece]:
        stream = self.client.chat(prompt, session_id, request_output_len=gen.max_new_tokens, stream=True,
                                  top_p=gen.top_p, top_k=gen.top_k, temperature=gen.temperature,
                                  repetition_penalty=gen.repetition_penalty)
        return (Piece(*out) for out in stream)

    def stop(self, session_id: int) -> None:
        self.client.cancel(session_id)

    def end(self, session_id: int) -> None:
        self.client.end_session(session_id)

    def close(self) -> None:
        self.client.close()

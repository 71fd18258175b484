"""A Python client for a conveyor (or LMDeploy) api_server, with LMDeploy's method names.

Every method is a generator of response dicts: one dict when ``stream=False``, one per chunk
when streaming. HTTP errors raise ``APIError`` carrying the server's OpenAI error envelope; a
server that cannot be reached raises ``APIConnectionError``. Importing this module does not
import torch or the engine.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

from conveyor.protocol.sampling import INTERACTIVE_DEFAULTS, OPENAI_DEFAULTS

# The server's sampling defaults per route (LMDeploy's api_server's), sent as the methods' defaults.
_OPENAI, _INTERACTIVE = OPENAI_DEFAULTS, INTERACTIVE_DEFAULTS
INTERACTIVE_OUTPUT_LEN = _INTERACTIVE.max_new_tokens  # request_output_len's default in LMDeploy's documentation
SESSION_BUSY_WAIT_S = 10.0  # how long chat() waits for a session's previous turn to end


class APIError(RuntimeError):
    """The server answered with an error status (``code``/``param``: the envelope's)."""

    def __init__(self, status: int, body: Any):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {err.get('message', body)}")
        self.status, self.body = status, body
        self.code, self.param = err.get("code"), err.get("param")


class APIConnectionError(ConnectionError):
    """The server could not be reached, or closed the connection mid-answer."""


def normalize_url(url: str) -> str:
    """``localhost:23333`` -> ``http://localhost:23333`` (as curl reads it); no trailing slash."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def new_session_id() -> int:
    """A random session id for one client: two clients (or one restarted) never share a
    conversation. Below 2**31, which every server's session ids hold."""
    return 1 + secrets.randbelow(2**31 - 2)


class APIClient:
    """Talks to ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/chat/interactive``,
    and loads LoRA adapters (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``). A request runs
    with an adapter when its ``model`` is the adapter's name (``adapter_name`` on the interactive calls)."""

    def __init__(self, api_server_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.base = normalize_url(api_server_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    @property
    def available_models(self) -> list[str]:
        """Names of the served models."""
        with self._connection():
            r = self._http.get("/v1/models")
        self._check(r)
        return [m["id"] for m in r.json()["data"]]

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Have the server load the PEFT LoRA checkpoint at ``path`` (on the server's host) as
        ``name``; returns the server's message. APIError if it refuses (a bad checkpoint: 400)."""
        return self._post_text("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> str:
        """Have the server forget the LoRA adapter ``name`` (APIError 404 for one not loaded)."""
        return self._post_text("/v1/unload_lora_adapter", {"lora_name": name})

    def _post_text(self, path: str, payload: dict[str, Any]) -> str:
        with self._connection():
            r = self._http.post(path, json=payload)
        self._check(r)
        return r.text

    @contextlib.contextmanager
    def _connection(self) -> Iterator[None]:
        """httpx's transport errors as one APIConnectionError that says what to check."""
        try:
            yield
        except httpx.ConnectError as exc:
            raise APIConnectionError(f"cannot connect to {self.base} ({exc}): is the server running there? "
                                     "(conveyor serve api_server MODEL --server-port PORT)") from None
        except httpx.TimeoutException as exc:
            raise APIConnectionError(f"{self.base} did not answer in time ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise APIConnectionError(f"the connection to {self.base} failed: {exc or type(exc).__name__}") from None

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code >= 400:
            r.read()
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise APIError(r.status_code, body)

    def _post(self, path: str, payload: dict[str, Any], stream: bool, sse: bool = True) -> Iterator[dict]:
        payload = {k: v for k, v in payload.items() if v is not None}
        if not stream:
            with self._connection():
                r = self._http.post(path, json=payload)
            self._check(r)
            yield r.json()
            return
        with self._connection(), self._http.stream("POST", path, json=payload) as r:
            self._check(r)
            for line in r.iter_lines():
                if not line.strip():
                    continue
                if sse:
                    if not line.startswith("data:"):
                        continue
                    line = line[len("data:"):].strip()
                    if line == "[DONE]":
                        return
                chunk = json.loads(line)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise APIError(r.status_code, chunk)
                yield chunk

    def chat_completions_v1(self, model: str, messages: str | list[dict], temperature: float = _OPENAI.temperature,
                            top_p: float = _OPENAI.top_p, logprobs: bool = False, top_logprobs: int | None = None,
                            n: int = 1, max_tokens: int | None = None, stop: str | list[str] | None = None,
                            stream: bool = False, user: str | None = None,
                            repetition_penalty: float = _OPENAI.repetition_penalty, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[dict]:
        """OpenAI chat completions; a string is one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        payload = dict(model=model, messages=messages, temperature=temperature, top_p=top_p, logprobs=logprobs,
                       top_logprobs=top_logprobs, n=n, max_tokens=max_tokens, stop=stop, stream=stream, user=user,
                       repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, **kwargs)
        yield from self._post("/v1/chat/completions", payload, stream)

    def completions_v1(self, model: str, prompt: str | list, temperature: float = _OPENAI.temperature, n: int = 1,
                       max_tokens: int = 16, stream: bool = False, stop: str | list[str] | None = None,
                       top_p: float = _OPENAI.top_p, top_k: int = _OPENAI.top_k, user: str | None = None,
                       repetition_penalty: float = _OPENAI.repetition_penalty,
                       ignore_eos: bool = False, skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[dict]:
        """OpenAI text completions."""
        payload = dict(model=model, prompt=prompt, temperature=temperature, n=n, max_tokens=max_tokens,
                       stream=stream, stop=stop, top_p=top_p, top_k=top_k, user=user,
                       repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, **kwargs)
        yield from self._post("/v1/completions", payload, stream)

    def chat_interactive_v1(self, prompt: str | list[dict], session_id: int = -1, interactive_mode: bool = False,
                            stream: bool = False, stop: str | list[str] | None = None,
                            request_output_len: int = INTERACTIVE_OUTPUT_LEN, top_p: float = _INTERACTIVE.top_p,
                            top_k: int = _INTERACTIVE.top_k, temperature: float = _INTERACTIVE.temperature,
                            repetition_penalty: float = _INTERACTIVE.repetition_penalty, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, adapter_name: str | None = None,
                            **kwargs: Any) -> Iterator[dict]:
        """LMDeploy's stateful endpoint: with interactive_mode the server keeps the history as KV.
        ``request_output_len`` is sent always (512, LMDeploy's documented default), so a server
        whose own default is unbounded does not generate for minutes. ``adapter_name``: the LoRA
        adapter the turn runs with (None: the base model)."""
        payload = dict(prompt=prompt, session_id=session_id, interactive_mode=interactive_mode, stream=stream,
                       stop=stop, request_output_len=request_output_len, top_p=top_p, top_k=top_k,
                       temperature=temperature, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, adapter_name=adapter_name, **kwargs)
        yield from self._post("/v1/chat/interactive", payload, stream, sse=False)

    def chat(self, prompt: str | list[dict], session_id: int, request_output_len: int = INTERACTIVE_OUTPUT_LEN,
             stream: bool = False, top_p: float = _INTERACTIVE.top_p, top_k: int = _INTERACTIVE.top_k,
             temperature: float = _INTERACTIVE.temperature, repetition_penalty: float = _INTERACTIVE.repetition_penalty,
             ignore_eos: bool = False, adapter_name: str | None = None) -> Iterator[tuple[str, int, str | None]]:
        """One turn of session ``session_id`` (LMDeploy's ``APIClient.chat``): yields (text, tokens,
        finish_reason), the text in pieces when ``stream``; the server keeps the history. A turn
        sent while the session's previous one is still ending (a stop string, a cancel) waits for
        it, up to ``SESSION_BUSY_WAIT_S``. ``adapter_name``: the LoRA adapter the turn runs with."""
        if session_id == -1:
            raise ValueError("chat() needs a session id of your own (not -1): it keeps the history under it")
        deadline = time.monotonic() + SESSION_BUSY_WAIT_S
        while True:
            outs = self.chat_interactive_v1(prompt, session_id=session_id, interactive_mode=True, stream=stream,
                                            request_output_len=request_output_len, top_p=top_p, top_k=top_k,
                                            temperature=temperature, repetition_penalty=repetition_penalty,
                                            ignore_eos=ignore_eos, adapter_name=adapter_name)
            try:
                first = next(outs, None)  # the request is sent here; a busy session is refused before any text
            except APIError as exc:
                if exc.code != "session_busy" or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            break
        for out in ([first] if first is not None else []):
            yield out.get("text", ""), out.get("tokens", 0), out.get("finish_reason")
        for out in outs:
            yield out.get("text", ""), out.get("tokens", 0), out.get("finish_reason")

    def cancel(self, session_id: int) -> None:
        """Abort the session's running turn (its history so far is kept)."""
        for _ in self.chat_interactive_v1("", session_id=session_id, cancel=True):
            pass

    def end_session(self, session_id: int) -> None:
        """Free a session's history on the server."""
        for _ in self.chat_interactive_v1("", session_id=session_id, interactive_mode=False, end=True):
            pass


def terminal_chat(api_server_url: str, api_key: str | None = None, session_id: int | None = None,
                  request_output_len: int = INTERACTIVE_OUTPUT_LEN) -> int:
    """``conveyor serve api_client URL``: a multi-turn chat whose history stays on the server.

    The conversation is a session of its own (a random id unless ``session_id`` names one to
    resume). Ctrl-C during an answer cancels that turn; at the prompt (or Ctrl-D, 'exit') it
    quits, ending the session. Returns the exit code; errors are one line on stderr.
    """
    client = APIClient(api_server_url, api_key)
    sid = new_session_id() if session_id is None else session_id
    try:
        try:
            models = client.available_models
        except (APIError, APIConnectionError) as exc:
            print(f"conveyor: {exc}", file=sys.stderr)
            return 1
        print(f"connected to {client.base} (models: {', '.join(models)}; session {sid}); "
              "'exit' or Ctrl-D quits, 'end' starts over, Ctrl-C stops an answer")
        return _chat_loop(client, sid, request_output_len)
    finally:
        client.close()


def _chat_loop(client: APIClient, sid: int, request_output_len: int) -> int:
    try:
        while True:
            try:
                prompt = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                break
            if prompt.strip() == "exit":
                break
            if prompt.strip() == "end":
                client.end_session(sid)
                continue
            if not prompt.strip():
                continue
            try:
                for text, _, _ in client.chat(prompt, sid, request_output_len=request_output_len, stream=True):
                    print(text, end="", flush=True)
                print()
            except KeyboardInterrupt:  # stop this answer, keep the conversation
                print(" [stopped]")
                with contextlib.suppress(APIError):  # the turn may have ended meanwhile
                    client.cancel(sid)
            except APIError as exc:  # a refused turn (too long, ...): say so, keep going
                print(f"\nconveyor: {exc}", file=sys.stderr)
    except APIConnectionError as exc:
        print(f"\nconveyor: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(APIError, APIConnectionError, KeyboardInterrupt):
            client.end_session(sid)  # free the server's cache; a server already gone has nothing to free
    return 0

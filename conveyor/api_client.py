"""A Python client for a conveyor (or LMDeploy) api_server, with LMDeploy's method names.

Every method is a generator of response dicts: one dict when ``stream=False``, one per chunk
when streaming. HTTP errors raise ``APIError`` carrying the server's OpenAI error envelope.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class APIError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, status: int, body: Any):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {err.get('message', body)}")
        self.status, self.body = status, body


class APIClient:
    """Talks to ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/chat/interactive``."""

    def __init__(self, api_server_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.base = api_server_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    @property
    def available_models(self) -> list[str]:
        """Names of the served models."""
        r = self._http.get("/v1/models")
        self._check(r)
        return [m["id"] for m in r.json()["data"]]

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
            r = self._http.post(path, json=payload)
            self._check(r)
            yield r.json()
            return
        with self._http.stream("POST", path, json=payload) as r:
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

    def chat_completions_v1(self, model: str, messages: str | list[dict], temperature: float = 0.7,
                            top_p: float = 1.0, logprobs: bool = False, top_logprobs: int | None = None,
                            n: int = 1, max_tokens: int | None = None, stop: str | list[str] | None = None,
                            stream: bool = False, user: str | None = None, repetition_penalty: float = 1.0,
                            ignore_eos: bool = False, skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[dict]:
        """OpenAI chat completions; a string is one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        payload = dict(model=model, messages=messages, temperature=temperature, top_p=top_p, logprobs=logprobs,
                       top_logprobs=top_logprobs, n=n, max_tokens=max_tokens, stop=stop, stream=stream, user=user,
                       repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, **kwargs)
        yield from self._post("/v1/chat/completions", payload, stream)

    def completions_v1(self, model: str, prompt: str | list, temperature: float = 0.7, n: int = 1,
                       max_tokens: int = 16, stream: bool = False, stop: str | list[str] | None = None,
                       top_p: float = 1.0, top_k: int = 40, user: str | None = None, repetition_penalty: float = 1.0,
                       ignore_eos: bool = False, skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[dict]:
        """OpenAI text completions."""
        payload = dict(model=model, prompt=prompt, temperature=temperature, n=n, max_tokens=max_tokens,
                       stream=stream, stop=stop, top_p=top_p, top_k=top_k, user=user,
                       repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, **kwargs)
        yield from self._post("/v1/completions", payload, stream)

    def chat_interactive_v1(self, prompt: str | list[dict], session_id: int = -1, interactive_mode: bool = False,
                            stream: bool = False, stop: str | list[str] | None = None,
                            request_output_len: int | None = None, top_p: float = 0.8, top_k: int = 40,
                            temperature: float = 0.8, repetition_penalty: float = 1.0, ignore_eos: bool = False,
                            skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[dict]:
        """LMDeploy's stateful endpoint: with interactive_mode the server keeps the history as KV."""
        payload = dict(prompt=prompt, session_id=session_id, interactive_mode=interactive_mode, stream=stream,
                       stop=stop, request_output_len=request_output_len, top_p=top_p, top_k=top_k,
                       temperature=temperature, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                       skip_special_tokens=skip_special_tokens, **kwargs)
        yield from self._post("/v1/chat/interactive", payload, stream, sse=False)

    def chat(self, prompt: str | list[dict], session_id: int, request_output_len: int = 512, stream: bool = False,
             top_p: float = 0.8, top_k: int = 40, temperature: float = 0.8, repetition_penalty: float = 1.0,
             ignore_eos: bool = False) -> Iterator[tuple[str, int, str | None]]:
        """One turn of session ``session_id`` (LMDeploy's ``APIClient.chat``): yields (text, tokens,
        finish_reason), the text in pieces when ``stream``; the server keeps the history."""
        if session_id == -1:
            raise ValueError("chat() needs a session id of your own (not -1): it keeps the history under it")
        for out in self.chat_interactive_v1(prompt, session_id=session_id, interactive_mode=True, stream=stream,
                                            request_output_len=request_output_len, top_p=top_p, top_k=top_k,
                                            temperature=temperature, repetition_penalty=repetition_penalty,
                                            ignore_eos=ignore_eos):
            yield out.get("text", ""), out.get("tokens", 0), out.get("finish_reason")

    def end_session(self, session_id: int) -> None:
        """Free a session's history on the server."""
        for _ in self.chat_interactive_v1("", session_id=session_id, interactive_mode=False, end=True):
            pass


def terminal_chat(api_server_url: str, api_key: str | None = None, session_id: int = 1,
                  request_output_len: int = 512) -> int:
    """``conveyor serve api_client URL``: a multi-turn chat whose history stays on the server."""
    client = APIClient(api_server_url, api_key)
    print(f"connected to {api_server_url} (models: {', '.join(client.available_models)}); "
          "'exit' quits, 'end' starts over")
    try:
        while True:
            try:
                prompt = input("> ")
            except EOFError:
                break
            if prompt.strip() == "exit":
                break
            if prompt.strip() == "end":
                client.end_session(session_id)
                continue
            if not prompt.strip():
                continue
            for chunk in client.chat_interactive_v1(prompt, session_id=session_id, interactive_mode=True,
                                                    stream=True, request_output_len=request_output_len):
                print(chunk.get("text", ""), end="", flush=True)
            print()
    finally:
        client.end_session(session_id)
        client.close()
    return 0

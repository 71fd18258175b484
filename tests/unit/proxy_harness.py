"""The proxy app on a real uvicorn server in a thread, and stand-in nodes that misbehave on cue
(never answer, stall mid-answer, send a large answer), for the proxy's unit tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import uvicorn

from conveyor.testing.server_process import free_port
from conveyor.services.proxy import build_proxy_app

MODEL = "stand-in"
ANSWER = {"id": "x", "object": "chat.completion", "model": MODEL,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


class ProxyServer:
    """``build_proxy_app(**options)`` served on 127.0.0.1 in a thread (lifespan on: health polling)."""

    def __init__(self, **options: Any):
        self.app = build_proxy_app(**options)
        self.url = f"http://127.0.0.1:{free_port()}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                     log_level="warning", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=asyncio.run, args=(self._server.serve(),), daemon=True)

    @property
    def table(self):
        return self.app.state.proxy.table

    def __enter__(self) -> "ProxyServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the proxy did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


class StandInNode:
    """An api_server stand-in whose /health always passes and whose completions answer as ``mode``
    says: ``ok``, ``hang`` (take the request, never answer), ``stall_stream`` (one event, then
    nothing), ``stall_body`` (half a body, then nothing), ``big`` (``size`` bytes in two halves,
    the second sent once ``go`` is set), ``big_then_break`` (half of ``size``, then the connection
    is cut). Hung handlers are let go on exit."""

    def __init__(self, mode: str = "ok", size: int = 0):
        self.mode, self.size = mode, size
        self.release, self.go, self.took = threading.Event(), threading.Event(), threading.Event()
        self.go_in_time: bool | None = None
        self.auth: list[str | None] = []  # the Authorization of every request, in order
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: pytest shows failures anyway
                pass

            def do_GET(self) -> None:
                node.auth.append(self.headers.get("Authorization"))
                body = {"status": "ok"} if self.path == "/health" else \
                    {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                self._send(200, json.dumps(body).encode())

            def do_POST(self) -> None:
                node.auth.append(self.headers.get("Authorization"))
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                node.took.set()
                node.answer(self, request)

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.handler = Handler
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def answer(self, h: BaseHTTPRequestHandler, request: dict) -> None:
        """Answer one completion request as ``mode`` says."""
        if self.mode == "hang":
            self.release.wait()
            return
        if self.mode == "ok":
            if request.get("stream"):
                self._head(h, "text/event-stream")
                h.wfile.write(EVENT + b"data: [DONE]\n\n")
            else:
                h._send(200, json.dumps(ANSWER).encode())  # type: ignore[attr-defined]
            return
        if self.mode == "stall_stream":
            self._head(h, "text/event-stream")
            h.wfile.write(EVENT)
            h.wfile.flush()
            self.release.wait()
            return
        body = self.expected_body()
        self._head(h, "application/json", len(body))
        h.wfile.write(body[:len(body) // 2])
        h.wfile.flush()
        if self.mode == "stall_body":
            self.release.wait()
        elif self.mode == "big":
            self.go_in_time = self.go.wait(5)
            h.wfile.write(body[len(body) // 2:])
        elif self.mode == "big_then_break":
            h.close_connection = True  # the declared length never arrives

    @staticmethod
    def _head(h: BaseHTTPRequestHandler, content_type: str, length: int | None = None) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if length is not None:
            h.send_header("Content-Length", str(length))
        else:
            h.send_header("Connection", "close")  # the body ends with the connection
        h.end_headers()

    def expected_body(self) -> bytes:
        """The body ``big`` modes send."""
        return json.dumps({"pad": "x" * max(self.size, 1000)}).encode()

    def __enter__(self) -> "StandInNode":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.go.set()
        self._server.shutdown()
        self._server.server_close()

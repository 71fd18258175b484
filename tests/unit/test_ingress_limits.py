"""The ingress's limits (services/ingress/limits.py) against the fake engine client of test_ingress.

Each test would fail without its limit: the request would be tokenized, queued, left running
or left holding its socket.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import uvicorn

from conveyor.services.ingress.app import build_app
from conveyor.services.ingress.limits import IngressLimits, with_header_timeout
from test_ingress import PROMPT, FakeEngineClient, assert_error, chat_body, http, still_serves

pytestmark = pytest.mark.anyio


async def test_a_prompt_over_the_character_cap_is_refused_before_tokenizing(engine) -> None:
    app = build_app(engine, limits=IngressLimits(max_prompt_chars=100))
    big = "x " * 60  # 120 characters
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "system", "content": "s" * 50}, {"role": "user", "content": "u" * 51}])), 400)
        assert err["param"] == "messages" and err["code"] == "prompt_too_long" and "101" in err["message"]
        err = assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": ["a", big]}), 400)
        assert err["param"] == "prompt"
        err = assert_error(await c.post("/v1/chat/interactive", json={"prompt": big}), 400)
        assert err["param"] == "prompt"
        await still_serves(c)
    assert len(engine.requests) == 1  # only the last one reached the engine client


async def test_the_default_character_cap_follows_the_context(engine) -> None:
    cap = IngressLimits().prompt_chars_cap(engine.session_len)
    assert cap == 32 * engine.session_len
    async with http(build_app(engine)) as c:
        assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": "y" * (cap + 1)}), 400)


async def test_prompt_list_and_n_times_prompts_are_capped(engine) -> None:
    app = build_app(engine, limits=IngressLimits(max_prompts=3, max_sequences=4))
    async with http(app) as c:
        err = assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": ["a"] * 4}), 400)
        assert err["param"] == "prompt" and err["code"] == "too_many_prompts"
        err = assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": ["a", "b"], "n": 3}),
                           400)
        assert err["param"] == "n" and err["code"] == "too_many_choices" and "6" in err["message"]
        assert_error(await c.post("/v1/chat/completions", json=chat_body(n=5)), 400)
        ok = await c.post("/v1/completions", json={"model": "fake-model", "prompt": ["a", "b"], "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
    assert not engine.active


async def test_a_full_queue_answers_429_with_retry_after_and_frees_its_places(engine) -> None:
    engine.hang_after = 0  # every request waits until it is aborted
    app = build_app(engine, limits=IngressLimits(max_queued=3))
    async with http(app) as c:
        held = [asyncio.create_task(c.post("/v1/chat/completions", json=chat_body())) for _ in range(3)]
        while len(engine.active) < 3:
            await asyncio.sleep(0.01)
        resp = await c.post("/v1/chat/completions", json=chat_body())
        err = assert_error(resp, 429)
        assert resp.headers["Retry-After"] == "5" and err["code"] == "rate_limit_exceeded"
        assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": "a b"}), 429)
        for rid in list(engine.active):  # the three end: their places come back
            engine._abort_events[rid].set()
        await asyncio.gather(*held)
        engine.hang_after = None
        await still_serves(c)
    assert app.state.ingress.sequences == 0 and app.state.ingress.inflight == 0


async def test_more_generations_than_the_queue_holds_is_400_not_429(engine) -> None:
    """A request the queue can never hold would get 429 "retry later" forever: it is a bad request."""
    app = build_app(engine, limits=IngressLimits(max_queued=3))
    async with http(app) as c:  # an empty queue
        resp = await c.post("/v1/chat/completions", json=chat_body(n=4))
        err = assert_error(resp, 400)
        assert "Retry-After" not in resp.headers and err["param"] == "n" and err["code"] == "too_many_choices"
        assert "at most 3 (--max-queued-requests)" in err["message"] and "4 generations" in err["message"]
        err = assert_error(await c.post("/v1/completions", json={"model": "fake-model", "prompt": ["a", "b"],
                                                                 "n": 2}), 400)
        assert "at most 3" in err["message"]
        assert (await c.post("/v1/chat/completions", json=chat_body(n=3))).status_code == 200
    assert not engine.active and app.state.ingress.sequences == 0


async def test_a_slow_body_gets_408(engine) -> None:
    app = build_app(engine, limits=IngressLimits(body_timeout_s=0.2))
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(10)  # the client sends headers, then nothing
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    start = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), 5)
    assert sent[0]["status"] == 408 and time.monotonic() - start < 2
    assert b"request_timeout" in sent[1]["body"]


def test_slow_or_silent_headers_close_the_connection() -> None:
    """A real uvicorn server: a client that opens a connection and sends part of its headers is
    cut after the header timeout; a normal request on another connection is answered."""
    engine = FakeEngineClient()
    app = build_app(engine, limits=IngressLimits(header_timeout_s=0.5))
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=with_header_timeout(AutoHTTPProtocol, 0.5))
    server = uvicorn.Server(config)

    async def scenario() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            silent = socket.create_connection(("127.0.0.1", port))
            slow = socket.create_connection(("127.0.0.1", port))
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
            start = time.monotonic()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                resp = await c.post("/v1/chat/completions", json=chat_body())
                assert resp.json()["choices"][0]["message"]["content"] == PROMPT
            for sock in (silent, slow):
                sock.settimeout(5)
                assert await asyncio.to_thread(sock.recv, 1024) == b"", "the server kept a slow client's socket"
                sock.close()
            assert time.monotonic() - start < 4
        finally:
            server.should_exit = True
            await task

    asyncio.run(scenario())


def test_past_the_connection_limit_503_is_openai_json_with_retry_after() -> None:
    """A real uvicorn server with two connections allowed: while another client holds one, a
    request gets the JSON 503 with Retry-After (uvicorn's own is plain text without it); once
    it is closed, requests are served."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from conveyor.services.ingress.limits import with_connection_limit

    app = build_app(FakeEngineClient())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off", limit_concurrency=2,
                            http=with_connection_limit(with_header_timeout(AutoHTTPProtocol, 10)))
    server = uvicorn.Server(config)

    async def scenario() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            idle = socket.create_connection(("127.0.0.1", port))
            await asyncio.sleep(0.1)  # the server has accepted it
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                resp = await c.post("/v1/chat/completions", json=chat_body())
                err = assert_error(resp, 503)
                assert resp.headers["Retry-After"] == "5" and resp.headers["content-type"] == "application/json"
                assert err["code"] == "too_many_connections" and err["type"] == "service_unavailable"
            idle.close()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                for _ in range(50):  # until the server has seen the idle connection go
                    resp = await c.post("/v1/chat/completions", json=chat_body())
                    if resp.status_code != 503:
                        break
                    await asyncio.sleep(0.05)
                assert resp.json()["choices"][0]["message"]["content"] == PROMPT
        finally:
            server.should_exit = True
            await task

    asyncio.run(scenario())


def test_limits_refuse_nonsense() -> None:
    for bad in ({"max_prompts": 0}, {"max_queued": 0}, {"header_timeout_s": 0}, {"request_timeout_s": -1},
                {"max_prompt_chars": 0}):
        with pytest.raises(ValueError):
            IngressLimits(**bad)

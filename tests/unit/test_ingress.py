"""The HTTP ingress against a deterministic fake engine client: shapes, errors, sessions, aborts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from conveyor.protocol import EngineStats, GenerateReq, LoadReport
from conveyor.services.engine_client import RequestError, RequestOutput
from conveyor.services.ingress.app import begin_drain, build_app, inflight_requests

pytestmark = pytest.mark.anyio

PROMPT = "hello world foo"


async def post_json(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` as ASCII JSON: lone surrogates travel as \\uXXXX escapes (httpx's json= would
    try to encode them as UTF-8 and fail on the client's side)."""
    return await c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


class FakeEngineClient:
    """Echoes the prompt's words (the last message's, for chat), one token per delta.

    Token i of an answer has id 1000 + i and logprob -0.5; alternatives are 2000 + j with -1 - j.
    Knobs: ``fail`` (raised before any output), ``fail_after`` (raised after that many outputs),
    ``hang_after`` (block after that many outputs until aborted), ``delay`` (seconds per token),
    ``settle`` (seconds a session stays busy after its turn's last output, as in the engine while
    a stop string's StopReq is on its way). Sessions live here, as in the engine: their token
    counts and running turns.
    """

    model_name = "fake-model"
    session_len = 64
    reply_to = "inproc://fake-ingress"

    def __init__(self) -> None:
        self.healthy = True
        self.load: LoadReport | None = LoadReport(reply_to="", sent_at=0.0,
                                                  engine=EngineStats(running=3, waiting=2, kv_usage=0.5))
        self.requests: list[GenerateReq] = []
        self.aborted: list[str] = []  # rids whose stream was closed before it finished
        self.abort_calls: list[str] = []
        self.ended: list[int] = []
        self.fail: RequestError | None = None
        self.fail_after: int | None = None
        self.hang_after: int | None = None
        self.delay = 0.0
        self.settle = 0.0
        self.active: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}
        self.sessions: dict[int, int] = {}  # session id -> its tokens
        self.stages: dict = {}  # StageStatus by stage name, as the launcher reports them
        self.down: list[str] = []
        self.serving_blocked_by: list[str] = []  # what the real client derives from down
        self.session_turns: dict[int, str] = {}  # session id -> rid of its running turn

    @property
    def num_inflight(self) -> int:
        return len(self.active)

    @staticmethod
    def words(req: GenerateReq) -> list[str]:
        if req.prompt is not None:
            return req.prompt.split()
        if req.messages is not None:
            return req.messages[-1]["content"].split()
        return [f"t{i}" for i in req.input_ids or []]

    async def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        if self.fail is not None:
            raise self.fail
        words = self.words(req)
        sid = req.session_id
        if sid in self.session_turns:
            raise RequestError(400, f"session {sid} is still generating", param="session_id", code="session_busy")
        history = self.sessions.get(sid, 0)
        if history + len(words) >= self.session_len:
            raise RequestError(400, f"the prompt is {len(words)} tokens but session_len is {self.session_len}",
                               param="messages")
        if sid is not None:
            self.session_turns[sid] = req.rid
        budget = req.params.max_new_tokens
        n_out, reason = min(budget, len(words)), ("length" if budget < len(words) else "stop")
        abort = self._abort_events[req.rid] = asyncio.Event()
        self.active.add(req.rid)
        finished = False
        try:
            await asyncio.sleep(0)
            for i in range(n_out):
                if self.fail_after == i:
                    raise RequestError(503, "the engine died", type="service_unavailable", code="engine_unavailable")
                if self.hang_after == i:
                    await abort.wait()
                    finished = True
                    yield RequestOutput("", [], "abort", len(words), i, 0, history_tokens=history)
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                tid, last = 1000 + i, i == n_out - 1
                lps = None
                if req.params.logprobs is not None:
                    lps = [{tid: -0.5, **{2000 + j: -1.0 - j for j in range(req.params.logprobs)}}]
                finished = last
                if sid is not None and last:
                    self.sessions[sid] = history + len(words) + n_out
                yield RequestOutput(words[i] if i == 0 else " " + words[i], [tid], reason if last else None,
                                    len(words), i + 1, 1, lps, history_tokens=history)
        finally:
            if sid is not None and self.settle and finished:
                asyncio.get_running_loop().call_later(self.settle, self.session_turns.pop, sid, None)
            elif sid is not None:
                self.session_turns.pop(sid, None)
            self.active.discard(req.rid)
            self._abort_events.pop(req.rid, None)
            if not finished:
                self.aborted.append(req.rid)

    async def cancel_session(self, session_id: int) -> None:
        rid = self.session_turns.get(session_id)
        if rid is not None:
            self.abort_calls.append(rid)
            if rid in self._abort_events:  # not when the turn has ended and only settles
                self._abort_events[rid].set()

    async def end_session(self, session_id: int) -> None:
        self.ended.append(session_id)
        self.sessions.pop(session_id, None)


def http(app: Any, **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kw)


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}], **kw}


def sse_events(text: str) -> list[Any]:
    """The data of each server-sent event ('[DONE]' kept as a string)."""
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


async def still_serves(c: httpx.AsyncClient) -> None:
    resp = await c.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == PROMPT


async def asgi_request(app: Any, path: str, body: dict[str, Any], *, disconnect_after_chunks: int | None = None,
                       disconnect_after_s: float | None = None) -> tuple[int | None, list[bytes]]:
    """Drive the app by hand so that the client can vanish mid-request (httpx's ASGI transport cannot)."""
    raw = json.dumps(body).encode()
    gone, body_sent = asyncio.Event(), False
    status: int | None = None
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message.get("body"):
            chunks.append(message["body"])
            if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("testclient", 1), "server": ("test", 80)}
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return status, chunks


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


# ---- shapes ------------------------------------------------------------------------------------

async def test_models_list(app) -> None:
    async with http(app) as c:
        body = (await c.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 64


async def test_served_model_name_overrides(engine) -> None:
    async with http(build_app(engine, served_model_name="alias")) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "alias"
        assert (await c.post("/v1/chat/completions", json=chat_body(model="alias"))).status_code == 200
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body()), 404)
        assert "alias" in err["message"]


async def test_chat_non_stream(app, engine) -> None:
    async with http(app) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(user="u1", tools=[], logit_bias={}))
    assert resp.status_code == 200
    body = resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": PROMPT},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    req = engine.requests[0]
    assert req.messages == [{"role": "user", "content": PROMPT}] and req.reply_to == engine.reply_to
    assert req.do_preprocess and req.session_id is None
    opts = req.params
    assert (opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p, opts.logprobs) == (64, 0.7, 40, 1.0, None)


async def test_chat_sampling_options_mapped(app, engine) -> None:
    body = chat_body(temperature=0, top_p=0.5, top_k=-1, min_p=0.1, max_tokens=5, max_completion_tokens=7,
                     stop="x", seed=3, repetition_penalty=1.2, ignore_eos=True, skip_special_tokens=False,
                     min_new_tokens=2, presence_penalty=0.0, user="u-1",
                     messages=[{"role": "developer", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]}])
    async with http(app) as c:
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    req = engine.requests[0]
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    o = req.params
    assert (o.temperature, o.top_p, o.top_k, o.min_p, o.max_new_tokens, o.stop_words, o.random_seed) == \
        (0, 0.5, 0, 0.1, 7, ["x"], 3)
    assert (o.repetition_penalty, o.ignore_eos, o.skip_special_tokens, o.min_new_tokens) == (1.2, True, False, 2)


async def test_empty_logit_bias_is_accepted(app) -> None:
    async with http(app) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body(logit_bias={}))).status_code == 200


def test_api_keys_from_a_file_and_the_environment(tmp_path, monkeypatch) -> None:
    import argparse

    from conveyor.cli import API_KEYS_ENV, _api_keys

    keys = tmp_path / "keys"
    keys.write_text("# one a line\nsk-file-1\n\nsk-file-2\n")
    monkeypatch.setenv(API_KEYS_ENV, "sk-env-1, sk-env-2")
    args = argparse.Namespace(api_keys=["sk-flag"], api_keys_file=str(keys))
    assert _api_keys(args) == ["sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2"]
    monkeypatch.delenv(API_KEYS_ENV)
    assert _api_keys(argparse.Namespace(api_keys=None, api_keys_file=None)) is None


async def test_chat_stream_matches_non_stream(app) -> None:
    async with http(app) as c:
        whole = (await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))).json()
        resp = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert len(finishes) == 1 and finishes[0]["finish_reason"] == "length" and finishes[0]["delta"] == {}
    assert finishes[0] is chunks[-1]["choices"][0]
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert text == whole["choices"][0]["message"]["content"] == "hello world"
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 2
    assert all("usage" not in c for c in chunks)


async def test_chat_n2_and_seeds(app, engine) -> None:
    async with http(app) as c:
        body = (await c.post("/v1/chat/completions", json=chat_body(n=2, seed=10))).json()
        resp = await c.post("/v1/chat/completions", json=chat_body(n=2, stream=True))
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert all(ch["message"]["content"] == PROMPT for ch in body["choices"])
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6
    assert [r.params.random_seed for r in engine.requests[:2]] == [10, 11]
    assert len({r.rid for r in engine.requests}) == 4
    chunks = sse_events(resp.text)[:-1]
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["delta"].get("role") == "assistant"
        assert sum(ch["finish_reason"] is not None for ch in mine) == 1
        assert "".join(ch["delta"].get("content", "") for ch in mine) == PROMPT


async def test_include_usage_final_chunk(app) -> None:
    async with http(app) as c:
        resp = await c.post("/v1/chat/completions",
                            json=chat_body(stream=True, stream_options={"include_usage": True}))
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 6
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert all("usage" not in e for e in events[:-2])


async def test_completions_shapes(app, engine) -> None:
    async with http(app) as c:
        body = (await c.post("/v1/completions", json={"model": "fake-model", "prompt": PROMPT})).json()
        batch = (await c.post("/v1/completions", json={"prompt": ["a b", "c d e"], "n": 2, "max_tokens": 2})).json()
        ids = (await c.post("/v1/completions", json={"prompt": [5, 6], "echo": False})).json()
        echo = (await c.post("/v1/completions", json={"prompt": "x y", "echo": True})).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": PROMPT, "logprobs": None, "finish_reason": "stop"}]
    assert engine.requests[0].params.max_new_tokens == 16 and not engine.requests[0].do_preprocess
    assert engine.requests[0].prompt == PROMPT
    assert [(ch["index"], ch["text"], ch["finish_reason"]) for ch in batch["choices"]] == [
        (0, "a b", "stop"), (1, "a b", "stop"), (2, "c d", "length"), (3, "c d", "length")]
    assert batch["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    assert engine.requests[-2].input_ids == [5, 6] and ids["choices"][0]["text"] == "t5 t6"
    assert echo["choices"][0]["text"] == "x yx y"


async def test_completions_stream_matches_non_stream(app) -> None:
    payload = {"prompt": ["a b c", "d e"], "n": 2, "max_tokens": 2}
    async with http(app) as c:
        whole = (await c.post("/v1/completions", json=payload)).json()
        resp = await c.post("/v1/completions", json={**payload, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    for choice in whole["choices"]:
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]]
        assert "".join(ch["text"] for ch in mine) == choice["text"]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == [choice["finish_reason"]]


async def test_chat_logprobs(app, engine) -> None:
    async with http(app) as c:
        body = (await c.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2))).json()
        plain = (await c.post("/v1/chat/completions", json=chat_body(logprobs=True))).json()
        resp = await c.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=1, stream=True))
    assert engine.requests[0].params.logprobs == 2 and engine.requests[1].params.logprobs == 0
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["1000", "1001", "1002"]
    first = content[0]
    assert first["logprob"] == -0.5 and first["bytes"] == list(b"1000")
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("1000", -0.5), ("2000", -1.0)]
    assert plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    async with http(app) as c:  # as LMDeploy: top_logprobs without logprobs asks for nothing
        ignored = (await c.post("/v1/chat/completions", json=chat_body(top_logprobs=2))).json()
    assert ignored["choices"][0]["logprobs"] is None and engine.requests[-1].params.logprobs is None
    chunks = sse_events(resp.text)[:-1]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == ["1000", "1001", "1002"]


async def test_completion_logprobs_legacy_shape(app, engine) -> None:
    async with http(app) as c:
        body = (await c.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 2})).json()
    lp = body["choices"][0]["logprobs"]
    assert engine.requests[0].params.logprobs == 2
    assert lp["tokens"] == ["1000", "1001", "1002"] and lp["token_logprobs"] == [-0.5] * 3
    assert lp["top_logprobs"][0] == {"1000": -0.5, "2000": -1.0}
    assert lp["text_offset"] == [0, 5, 11]


class _Tok:
    """A stand-in tokenizer: id 1000 + i is word w{i}."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i - 1000}" for i in ids)


async def test_logprob_tokens_use_the_tokenizer(engine) -> None:
    async with http(build_app(engine, tokenizer=_Tok())) as c:
        body = (await c.post("/v1/chat/completions", json=chat_body(logprobs=True))).json()
        echo = (await c.post("/v1/completions", json={"prompt": [1000, 1001], "echo": True})).json()
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == [" w0", " w1", " w2"]
    assert echo["choices"][0]["text"].startswith(" w0 w1")


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (chat_body(temperature=-1), "temperature"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(n=0), "n"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(top_logprobs=30, logprobs=True), "top_logprobs"),
    (chat_body(messages=[]), "messages"),
    (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages.0.content.0.image_url.url"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
     "messages.0.content.0.type"),
    (chat_body(stop=5), "stop"),
    ({"model": "fake-model"}, "messages"),
    (chat_body(presence_penalty=0.5), "presence_penalty"),  # refused, not ignored: no such penalty here
    (chat_body(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content"),  # lone surrogate
    (chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
     "messages.0.content.0.text"),
    (chat_body(stop=["ok", "x\ud800"]), "stop.1"),
    (chat_body(stop=[""]), "stop.0"),  # the schema says so too: an empty stop string is refused
    (chat_body(repetition_penalty=1e-300), "repetition_penalty"),  # would make the logits (and logprobs) inf
    (chat_body(logit_bias={"5": 10.0}), "logit_bias"),  # refused, not ignored
    (chat_body(repetition_penalty=0), "repetition_penalty"),
    (chat_body(min_p=1.5), "min_p"),
])
async def test_bad_parameters_are_400(app, body: dict[str, Any], param: str | None) -> None:
    async with http(app) as c:
        err = assert_error(await post_json(c, "/v1/chat/completions", body), 400)
        assert err["type"] == "invalid_request_error" and err["param"] == param
        if param:
            assert err["message"].startswith(param)
        await still_serves(c)


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": []}, {"prompt": [-1]}, {"prompt": "x", "logprobs": 6},
                                  {"prompt": 5}, {"prompt": "x", "max_tokens": 0}, {"prompt": "a\ud800"},
                                  {"prompt": "x", "stop": [""]}])
async def test_bad_completion_parameters_are_400(app, body: dict[str, Any]) -> None:
    async with http(app) as c:
        assert_error(await post_json(c, "/v1/completions", body), 400)


async def test_malformed_bodies_are_400(app) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", content=b'{"model": ',
                                        headers={"content-type": "application/json"}), 400)
        assert "malformed JSON" in err["message"]
        err = assert_error(await c.post("/v1/chat/completions", json=[1, 2]), 400)
        assert "JSON object" in err["message"]
        assert_error(await c.post("/v1/chat/completions", content=b"hello"), 400)
        assert_error(await c.post("/v1/chat/completions"), 400)
        assert_error(await c.post("/v1/chat/completions", content=b'{"temperature": NaN}',
                                  headers={"content-type": "application/json"}), 400)
        await still_serves(c)


async def test_engine_errors_pass_through(app, engine) -> None:
    long = {"role": "user", "content": "w " * 80}
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(messages=[long])), 400)
        assert "80" in err["message"] and "64" in err["message"] and err["param"] == "messages"
        # Streamed too: the first output is awaited before answering, so the status is right.
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(messages=[long], stream=True)), 400)
        assert "session_len" in err["message"]
        engine.fail = RequestError(503, "engine down", type="service_unavailable", code="engine_unavailable")
        err = assert_error(await c.post("/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "engine_unavailable"
        engine.fail = None
        await still_serves(c)
    assert inflight_requests(app) == 0


async def test_mid_stream_error_then_done(app, engine) -> None:
    engine.fail_after = 2
    async with http(app) as c:
        resp = await c.post("/v1/chat/completions", json=chat_body(stream=True))
        assert resp.status_code == 200
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable"
        assert "".join(ch["delta"].get("content", "") for e in events[:-2] for ch in e["choices"]) == "hello world"
        engine.fail_after = None
        await still_serves(c)


async def test_api_keys(engine) -> None:
    app = build_app(engine, api_keys=["k1", "k2"])
    async with http(app) as c:
        err = assert_error(await c.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(await c.post("/v1/chat/completions", json=chat_body(),
                                  headers={"Authorization": "Bearer nope"}), 401)
        assert_error(await c.get("/metrics"), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer k2"})).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/openapi.json")).status_code == 200
        assert (await c.get("/docs")).status_code == 200
    async with http(app, headers={"Authorization": "Bearer k1"}) as c:
        await still_serves(c)
        assert (await c.get("/metrics")).status_code == 200


async def test_not_found_and_method(app) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(model="gpt-4")), 404)
        assert "fake-model" in err["message"] and err["code"] == "model_not_found"
        assert_error(await c.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
        assert_error(await c.get("/v1/nothing"), 404)
        err = assert_error(await c.get("/v1/chat/completions"), 405)
        assert "GET" in err["message"]
        await still_serves(c)


async def test_body_too_large(engine) -> None:
    app = build_app(engine, max_body_bytes=1000)
    big = chat_body(messages=[{"role": "user", "content": "x" * 2000}])
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=big), 413)
        assert "1000" in err["message"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the bytes are counted
            for _ in range(5):
                yield b" " * 300

        assert_error(await c.post("/v1/chat/completions", content=chunked(),
                                  headers={"content-type": "application/json"}), 413)
        await still_serves(c)
    assert engine.requests[-1].messages[0]["content"] == PROMPT and len(engine.requests) == 1


async def test_unhealthy_is_503(app, engine) -> None:
    engine.healthy = False
    async with http(app) as c:
        assert_error(await c.post("/v1/chat/completions", json=chat_body()), 503)
        assert_error(await c.get("/health"), 503)
        engine.healthy = True
        assert (await c.get("/health")).json() == {"status": "ok"}
        await still_serves(c)
    assert engine.requests[-1].messages is not None and len(engine.requests) == 1


async def test_draining(app, engine) -> None:
    engine.delay = 0.02
    async with http(app) as c:
        running = asyncio.ensure_future(c.post("/v1/chat/completions", json=chat_body()))
        while not engine.active:
            await asyncio.sleep(0.001)
        assert inflight_requests(app) == 1
        begin_drain(app)
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body()), 503)
        assert err["code"] == "draining"
        assert_error(await c.get("/health"), 503)
        finished = await running
    assert finished.status_code == 200 and finished.json()["choices"][0]["message"]["content"] == PROMPT
    assert inflight_requests(app) == 0


# ---- client disconnects ------------------------------------------------------------------------

async def test_stream_disconnect_aborts(app, engine) -> None:
    engine.hang_after = 2
    status, chunks = await asgi_request(app, "/v1/chat/completions", chat_body(stream=True),
                                        disconnect_after_chunks=2)
    await settle()
    assert status == 200 and b"hello" in b"".join(chunks)
    assert engine.aborted == [engine.requests[0].rid] and not engine.active
    assert inflight_requests(app) == 0


async def test_non_stream_disconnect_aborts(app, engine) -> None:
    engine.hang_after = 1
    await asgi_request(app, "/v1/chat/completions", chat_body(n=2), disconnect_after_s=0.05)
    await settle()
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.requests) and len(engine.aborted) == 2
    assert inflight_requests(app) == 0
    async with http(app) as c:
        engine.hang_after = None
        await still_serves(c)


async def test_disconnect_before_first_token_aborts(app, engine) -> None:
    engine.hang_after = 0
    status, _ = await asgi_request(app, "/v1/completions", {"prompt": "a b", "stream": True},
                                   disconnect_after_s=0.05)
    await settle()
    assert engine.aborted == [engine.requests[0].rid] and inflight_requests(app) == 0


# ---- /v1/chat/interactive ----------------------------------------------------------------------

async def test_interactive_session_flow(app, engine) -> None:
    async with http(app) as c:
        one = (await c.post("/v1/chat/interactive",
                            json={"prompt": "a b c", "session_id": 7, "interactive_mode": True})).json()
        two = (await c.post("/v1/chat/interactive",
                            json={"prompt": "d e", "session_id": 7, "interactive_mode": True,
                                  "request_output_len": 1})).json()
        lines = (await c.post("/v1/chat/interactive",
                              json={"prompt": "f g", "session_id": 7, "interactive_mode": True,
                                    "stream": True})).text.splitlines()
        stateless = (await c.post("/v1/chat/interactive", json={"prompt": "x y", "session_id": 7})).json()
    assert one == {"text": "a b c", "tokens": 3, "input_tokens": 3, "history_tokens": 0, "finish_reason": "stop",
                   "session_id": 7}
    assert two == {"text": "d", "tokens": 1, "input_tokens": 2, "history_tokens": 6, "finish_reason": "length",
                   "session_id": 7}
    r1, r2, r3, r4 = engine.requests
    # The engine knows whether a turn is a session's first: the ingress leaves sequence_start to it.
    assert (r1.session_id, r1.sequence_start, r2.session_id, r2.sequence_start) == (7, None, 7, None)
    assert (r1.params.top_k, r1.params.top_p, r1.params.temperature) == (40, 0.8, 0.8)
    # LMDeploy's request_output_len default, not the whole context (a turn cannot run for ever)
    assert r1.params.max_new_tokens == 512 and r2.params.max_new_tokens == 1
    streamed = [json.loads(line) for line in lines]
    assert "".join(s["text"] for s in streamed) == "f g" and streamed[-1]["finish_reason"] == "stop"
    assert [s["finish_reason"] for s in streamed].count("stop") == 1 and streamed[0]["history_tokens"] == 9
    assert r3.sequence_start is None
    # interactive_mode false ends the session and answers without one.
    assert engine.ended == [7] and r4.session_id is None and r4.sequence_start is True
    assert stateless["text"] == "x y"


async def test_interactive_fresh_id_end_and_errors(app, engine) -> None:
    async with http(app) as c:
        first = (await c.post("/v1/chat/interactive", json={"prompt": "hi", "interactive_mode": True})).json()
        sid = first["session_id"]
        assert sid > 2**32 and engine.requests[0].session_id == sid
        ended = (await c.post("/v1/chat/interactive", json={"session_id": sid, "end": True})).json()
        assert ended["text"] == "" and engine.ended == [sid]
        assert_error(await c.post("/v1/chat/interactive", json={"prompt": "", "interactive_mode": True}), 400)
        err = assert_error(await post_json(c, "/v1/chat/interactive", {"prompt": "a\ud800b", "interactive_mode": True}),
                           400)
        assert err["param"] == "prompt" and "lone surrogate" in err["message"]
        assert_error(await c.post("/v1/chat/interactive", json={"prompt": "x", "cancel": True}), 400)
        # A first turn the tokenizer refuses does not leave a session behind.
        assert_error(await c.post("/v1/chat/interactive",
                                  json={"prompt": "w " * 80, "session_id": 3, "interactive_mode": True}), 400)
        ok = (await c.post("/v1/chat/interactive",
                           json={"prompt": "ok", "session_id": 3, "interactive_mode": True})).json()
    assert ok["history_tokens"] == 0 and 3 in engine.sessions


async def test_interactive_cancel(app, engine) -> None:
    engine.hang_after = 1
    async with http(app) as c:
        turn = asyncio.ensure_future(c.post("/v1/chat/interactive",
                                            json={"prompt": "a b", "session_id": 5, "interactive_mode": True}))
        while not engine.active:
            await asyncio.sleep(0.001)
        busy = await c.post("/v1/chat/interactive", json={"prompt": "z", "session_id": 5, "interactive_mode": True})
        assert_error(busy, 400)
        cancel = await c.post("/v1/chat/interactive", json={"prompt": "", "session_id": 5, "cancel": True})
        assert cancel.status_code == 200
        result = (await turn).json()
    assert engine.abort_calls == [engine.requests[0].rid]
    assert result["finish_reason"] == "abort" and result["text"] == "a"


# ---- metrics, docs, the openai client ----------------------------------------------------------

async def test_metrics(app) -> None:
    async with http(app) as c:
        await still_serves(c)
        await c.post("/v1/chat/completions", json=chat_body(temperature=-1))
        text = (await c.get("/metrics")).text
    assert 'conveyor_http_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'conveyor_http_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
    assert "conveyor_prompt_tokens_total 3.0" in text and "conveyor_generation_tokens_total 3.0" in text
    assert "conveyor_requests_in_flight 0.0" in text
    assert "conveyor_engine_requests_running 3.0" in text and "conveyor_engine_requests_waiting 2.0" in text
    assert "conveyor_kv_cache_usage_ratio 0.5" in text
    assert "conveyor_time_to_first_token_seconds_count 1.0" in text
    assert "conveyor_inter_token_latency_seconds_count 2.0" in text
    assert "conveyor_e2e_request_latency_seconds_count 1.0" in text


async def test_metrics_do_not_show_a_dead_engines_last_numbers(app, engine) -> None:
    engine.load.stage_stats = {"engine_steps": 7.0}
    async with http(app) as c:
        assert 'conveyor_stage_stat{stat="engine_steps"} 7.0' in (await c.get("/metrics")).text
        engine.healthy = False  # the ring went silent: the last report is stale
        text = (await c.get("/metrics")).text
    assert "conveyor_engine_requests_running NaN" in text and "conveyor_kv_cache_usage_ratio NaN" in text
    assert "conveyor_engine_healthy 0.0" in text and "engine_steps" not in text


async def test_metrics_count_the_frames_the_ingress_could_not_decode() -> None:
    """A real EngineClient's result socket, sent garbage: /metrics counts what it dropped, as the
    stages' own *_bad_frames, also while the ring is silent (the count is the ingress's own)."""
    import zmq
    import zmq.asyncio

    from conveyor.protocol import Addresses
    from conveyor.services.engine_client import EngineClient

    ctx = zmq.asyncio.Context()
    client = EngineClient(Addresses.inproc(), "m", 64, ping_interval=0.05, context=ctx)
    await client.start()
    peer = ctx.socket(zmq.PUSH)
    peer.connect(client.reply_to)
    try:
        for junk in (b"\x00", b"\xff not msgpack", b""):
            await peer.send(junk)
        async with http(build_app(client)) as c:
            for _ in range(100):  # until the client's reader has taken all three
                text = (await c.get("/metrics")).text
                if 'conveyor_stage_stat{stat="ingress_bad_frames"} 3.0' in text:
                    break
                await asyncio.sleep(0.02)
        assert not client.healthy and 'conveyor_stage_stat{stat="ingress_bad_frames"} 3.0' in text
    finally:
        peer.close(0)
        await client.close()
        ctx.term()


async def test_openapi_lists_routes(app) -> None:
    async with http(app) as c:
        spec = (await c.get("/openapi.json")).json()
        assert (await c.get("/docs")).status_code == 200
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/chat/interactive", "/health",
            "/metrics"} <= set(spec["paths"])


async def test_official_openai_client(app) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1",
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
    async with client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
        done = await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=2, logprobs=True, top_logprobs=1)
        assert done.choices[0].message.content == "hello world" and done.choices[0].finish_reason == "length"
        assert done.usage.total_tokens == 5 and done.choices[0].logprobs.content[0].token == "1000"
        stream = await client.chat.completions.create(model="fake-model", stream=True,
                                                      messages=[{"role": "user", "content": PROMPT}],
                                                      stream_options={"include_usage": True})
        pieces, finishes, usage = [], [], None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        assert "".join(pieces) == PROMPT and finishes == ["stop"] and usage.completion_tokens == 3
        text = await client.completions.create(model="fake-model", prompt="a b c", max_tokens=2)
        assert text.choices[0].text == "a b"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                 temperature=5)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


async def test_the_root_leads_to_the_docs(app) -> None:
    async with http(app) as c:
        r = await c.get("/")
        assert r.status_code in (302, 307) and r.headers["location"] == "/docs"
        assert (await c.get("/docs")).status_code == 200

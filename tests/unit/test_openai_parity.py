"""OpenAI (and LMDeploy) request shapes a new user's client sends, against the ingress on the fake
engine: each is honoured, or refused with a 400 that names the field; never silently dropped."""

from __future__ import annotations

import logging

import pytest

from test_ingress import PROMPT, assert_error, chat_body, http

pytestmark = pytest.mark.anyio


async def test_one_model_by_id(app) -> None:
    async with http(app) as c:
        card = (await c.get("/v1/models/fake-model")).json()
        missing = assert_error(await c.get("/v1/models/org/other-model"), 404)
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert missing["code"] == "model_not_found" and "org/other-model" in missing["message"]


async def test_stream_options_need_stream(app) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions",
                                        json=chat_body(stream_options={"include_usage": True})), 400)
        ok = await c.post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert err["param"] == "stream_options" and ok.status_code == 200


@pytest.mark.parametrize("field, value", [
    # no --tool-call-parser and a template of no known tool format: the 400 names the flag
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),  # without tools
    ("functions", [{"name": "f", "parameters": {}}]),  # OpenAI's older names: the 400 says tools
    ("function_call", "auto"),
])
async def test_what_the_engine_cannot_do_is_refused(app, engine, field, value) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(**{field: value})), 400)
    assert err["param"] == field and not engine.requests


@pytest.mark.parametrize("value, kind", [
    ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
     "json_schema"),
])
async def test_response_format_reaches_the_engine_as_a_guide(app, engine, value, kind) -> None:
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(response_format=value))
    assert r.status_code == 200, r.text
    assert engine.requests[0].params.guide.kind == kind


async def test_their_no_op_values_are_accepted(app) -> None:
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(response_format={"type": "text"}, tools=[],
                                                                tool_choice="none"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == PROMPT


async def test_lmdeploy_bodies_stop_false_and_session_minus_one(app, engine) -> None:
    async with http(app) as c:
        chat = await c.post("/v1/chat/completions", json=chat_body(stop=False, session_id=-1))
        text = await c.post("/v1/completions", json={"model": "fake-model", "prompt": PROMPT, "stop": False,
                                                     "session_id": -1})
        interactive = await c.post("/v1/chat/interactive", json={"prompt": PROMPT, "session_id": -1,
                                                                 "interactive_mode": False, "stop": False,
                                                                 "request_output_len": 512})
        assert_error(await c.post("/v1/chat/completions", json=chat_body(stop=True)), 400)
        err = assert_error(await c.post("/v1/chat/completions", json=chat_body(session_id=7)), 400)
    assert [r.status_code for r in (chat, text, interactive)] == [200, 200, 200]
    assert all(r.params.stop_words == [] for r in engine.requests)
    assert err["param"] == "session_id" and "/v1/chat/interactive" in err["message"]


async def test_echo_with_logprobs_is_refused_not_half_answered(app) -> None:
    async with http(app) as c:
        err = assert_error(await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1}),
                           400)
        echo = (await c.post("/v1/completions", json={"prompt": PROMPT, "echo": True})).json()
    assert err["param"] == "echo" and echo["choices"][0]["text"].startswith(PROMPT)


async def test_every_request_writes_an_access_log_line(app, caplog) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.access")
    async with http(app) as c:
        await c.post("/v1/chat/completions", json=chat_body())
        await c.get("/v1/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "conveyor.access"]
    assert len(lines) == 2
    assert '"POST /v1/chat/completions" 200' in lines[0] and '"GET /v1/nope" 404' in lines[1]


async def test_docs_are_served_without_a_cdn(app) -> None:
    async with http(app) as c:
        page = (await c.get("/docs")).text
        redoc = (await c.get("/redoc")).text
        js = await c.get("/docs-assets/swagger-ui-bundle.js")
        css = await c.get("/docs-assets/swagger-ui.css")
        redoc_js = await c.get("/docs-assets/redoc.standalone.js")
    assert "cdn." not in page and "/docs-assets/swagger-ui-bundle.js" in page and "/openapi.json" in page
    assert "cdn." not in redoc and "fonts.googleapis" not in redoc
    assert js.status_code == css.status_code == redoc_js.status_code == 200
    assert len(js.content) > 500_000 and b"SwaggerUIBundle" in js.content

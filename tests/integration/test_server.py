"""A real server process on the real SmolLM2 model, driven with the official openai client."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from conveyor.testing.server_process import ServerProcess

KEY = "sk-conveyor-test"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    srv = ServerProcess(smollm2_dir, "--cache-max-entry-count", "256", "--cache-block-seq-len", "16",
                        "--session-len", "1024", "--tokenizer-workers", "2", "--enable-prefix-caching",
                        log_dir=tmp_path_factory.mktemp("server"), api_key=KEY)
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def engine_idle(server) -> dict:
    """Wait until the engine reports nothing running and every KV block free; return the metrics."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
        values = {}
        for line in text.splitlines():
            if line.startswith("conveyor_") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        running = next((v for k, v in values.items() if "running" in k), None)
        usage = next((v for k, v in values.items() if "kv" in k and "usage" in k), None)
        if running == 0 and usage == 0:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: running={running} kv_usage={usage}")
        time.sleep(0.2)


def test_models_and_health(server, client, smollm2_dir):
    assert [m.id for m in client.models.list().data] == [smollm2_dir.name]
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key


def test_chat_stream_equals_non_stream(client, model, hf_prompt_len):
    full = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=40)
    assert full.choices[0].finish_reason == "stop"
    text, finishes, usage = "", [], None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=40,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert text == full.choices[0].message.content
    assert finishes == ["stop"]
    assert full.usage.prompt_tokens == hf_prompt_len(MESSAGES)
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completions_and_n(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    n=2)
    assert len(out.choices) == 2
    assert out.choices[0].text == out.choices[1].text  # greedy: both the same
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 16
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_multi_token_stop_string(client, model):
    base = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=40)
    text = base.choices[0].message.content
    stop = text[9:17]  # several tokens from the middle
    out = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=40, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=40, stop=[stop], stream=True) if c.choices)
    assert streamed == text[: text.index(stop)]


def test_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=5,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def _post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(f"{server.url}{path}", content=raw, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("case, status", [
    ("bad_temperature", 400), ("zero_max_tokens", 400), ("malformed_json", 400), ("too_long", 400),
    ("no_key", 401), ("wrong_key", 401), ("unknown_model", 404), ("oversized", 413),
])
def test_errors_are_openai_envelopes_and_server_keeps_serving(server, model, case, status):
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    if case == "bad_temperature":
        r = _post(server, "/v1/chat/completions", {**chat, "temperature": -1})
    elif case == "zero_max_tokens":
        r = _post(server, "/v1/chat/completions", {**chat, "max_tokens": 0})
    elif case == "malformed_json":
        r = _post(server, "/v1/chat/completions", None, raw=b'{"model": "x", "messages": [')
    elif case == "too_long":
        r = _post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi " * 3000}]})
    elif case == "no_key":
        r = _post(server, "/v1/chat/completions", chat, key=None)
    elif case == "wrong_key":
        r = _post(server, "/v1/chat/completions", chat, key="sk-wrong")
    elif case == "unknown_model":
        r = _post(server, "/v1/chat/completions", {**chat, "model": "no-such-model"})
    else:
        r = _post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * (9 << 20)}]})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if case == "too_long":
        assert "1024" in err["message"] and any(ch.isdigit() for ch in err["message"].replace("1024", ""))
    ok = _post(server, "/v1/chat/completions", chat)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_client_disconnect_aborts_and_frees_blocks(server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # walk away mid-stream
    engine_idle(server)


def test_interactive_session_keeps_history(server):
    url = f"{server.url}/v1/chat/interactive"
    first = httpx.post(url, json={"prompt": "What is the capital of France?", "session_id": 7,
                                  "interactive_mode": True, "temperature": 0, "top_k": 1},
                       headers=server.headers(), timeout=60).json()
    assert first["text"] and first["finish_reason"] in ("stop", "length")
    second = httpx.post(url, json={"prompt": "And of Germany?", "session_id": 7, "interactive_mode": True,
                                   "temperature": 0, "top_k": 1}, headers=server.headers(), timeout=60).json()
    assert "Berlin" in second["text"] or second["text"]
    assert second["history_tokens"] > 0
    httpx.post(url, json={"prompt": "", "session_id": 7, "interactive_mode": False, "end": True},
               headers=server.headers(), timeout=60)
    engine_idle(server)


def test_metrics_count_requests_and_tokens(server):
    text = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    assert "conveyor_" in text
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # guarded when keys are set


def test_openapi_and_docs(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]
    assert httpx.get(f"{server.url}/docs").status_code == 200


@pytest.fixture(scope="module")
def hf_prompt_len(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return lambda messages: len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))


def test_json_body_shapes(server, model):
    r = _post(server, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 3})
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert json.loads(json.dumps(body))["usage"]["total_tokens"] > 0


def test_python_api_client(server, model):
    from conveyor.api_client import APIClient, APIError

    api = APIClient(server.url, api_key=KEY)
    assert api.available_models == [model]
    [full] = list(api.chat_completions_v1(model, MESSAGES, temperature=0, max_tokens=16))
    text = full["choices"][0]["message"]["content"]
    chunks = list(api.chat_completions_v1(model, MESSAGES, temperature=0, max_tokens=16, stream=True))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    [comp] = list(api.completions_v1(model, "The capital of France is", max_tokens=4, temperature=0))
    assert comp["choices"][0]["text"]
    first = list(api.chat_interactive_v1("What is the capital of France?", session_id=11, interactive_mode=True,
                                         temperature=0, top_k=1))[-1]
    second = list(api.chat_interactive_v1("And of Germany?", session_id=11, interactive_mode=True, stream=True,
                                          temperature=0, top_k=1))
    assert first["text"] and "".join(c["text"] for c in second)
    api.end_session(11)
    with pytest.raises(APIError) as info:
        list(api.chat_completions_v1("no-such-model", MESSAGES))
    assert info.value.status == 404
    api.close()
    engine_idle(server)


def test_terminal_api_client(server):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "api_client", server.url, "--api-key", KEY,
                           "--session-id", "21", "--request-output-len", "16"],
                          input="What is the capital of France?\nexit\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "connected to" in done.stdout and len(done.stdout.splitlines()) >= 2


def test_template_options_act_and_unknown_fields_are_refused_or_ignored(server, client, model, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    cont = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": {"unused": 1},
        "store": True})  # store: OpenAI's, unknown here: ignored (and logged)
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert cont.usage.prompt_tokens == len(tok(text)["input_ids"])
    parts = client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                     {"type": "text", "text": "of France?"}]}])
    assert parts.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as beam:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={"use_beam_search": True})
    # A constraint whose regex does not parse is the tokenizer stage's 400, before the engine.
    with pytest.raises(openai.BadRequestError) as regex:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={"guided_regex": "(a"})
    assert "use_beam_search" in str(beam.value) and "regex" in str(regex.value)
    engine_idle(server)


# ---- structured output -------------------------------------------------------------------------

OUTPUT_SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "text": {"type": "string", "maxLength": 20}},
        "required": ["n", "text"], "additionalProperties": False}}}, "required": ["steps"]},
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,6}$"}, "minItems": 2, "maxItems": 3},
]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_response_format_json_schema_output_validates(client, model, server):
    """A batch of schemas, sent at once, greedy and sampled (n=2), streamed and not: every
    output parses and validates against its schema and ends with a stop."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    def ask(schema, stream, temperature):
        kw = dict(model=model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=120,
                  temperature=temperature, response_format=_schema_format(schema), seed=5)
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            return [(text, finish)]
        r = client.chat.completions.create(n=2 if temperature else 1, **kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    cases = ([(s, False, 0) for s in OUTPUT_SCHEMAS] + [(OUTPUT_SCHEMAS[2], True, 0)]
             + [(s, False, 1.0) for s in OUTPUT_SCHEMAS[1::2]])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: ask(*c), cases))
    for (schema, _, _), outs in zip(cases, answers):
        for text, finish in outs:
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)
    engine_idle(server)


def test_guided_fields_and_json_object(client, model):
    ask = dict(model=model, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=30, temperature=0)
    r = client.chat.completions.create(extra_body={"guided_choice": ["yes", "no"]}, **ask)
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}"}, **ask)
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(extra_body={"structured_outputs": {"grammar": 'root ::= "(" [a-c]+ ")"'}},
                                       **ask)
    assert re.fullmatch(r"\([a-c]+\)", r.choices[0].message.content)
    r = client.chat.completions.create(response_format={"type": "json_object"}, **{**ask, "max_tokens": 100})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=model, prompt="The year:", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[12][0-9]{3}"})
    assert re.fullmatch("[12][0-9]{3}", r.choices[0].text)


@pytest.mark.parametrize("body, words", [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "strng"}}})},
     "json schema is invalid"),
    ({"guided_regex": "(unclosed"}, "regex is invalid"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json"),
])
def test_bad_constraints_are_400_envelopes(server, model, body, words):
    r = _post(server, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]

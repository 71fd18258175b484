"""Tool calling and reasoning on /v1/chat/completions, against an engine that prints a scripted
output: each tool-call format, streamed and whole, with the official openai client reading the
responses; what reaches the engine (tools for the template, the grammar of an enforced choice,
special tokens kept) and the 400s of requests that cannot be served."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from test_ingress import FakeEngineClient, assert_error, sse_events

from conveyor.protocol import GenerateReq
from conveyor.services.engine_client import RequestOutput
from conveyor.services.ingress.app import build_app
from conveyor.testing.openai_stream import gather
from conveyor.services.ingress.tool_calling import ChatParsing, calls_grammar, chat_parsing

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# What each format's model prints for: a word of content, then get_weather(Paris) and get_time().
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    "internlm": ('Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
                 '<|action_end|><|action_start|><|plugin|>\n{"name": "get_time", "parameters": {}}<|action_end|>'),
    "mistral": ('Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]'),
}
CONTENT = {"hermes": "Let me check.", "llama3_json": None, "internlm": "Let me check.", "mistral": "Let me check."}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


class ScriptedEngine(FakeEngineClient):
    """Prints ``script`` in pieces of ``step`` characters (one token each), then stops."""

    def __init__(self, script: str = "", step: int = 3, reason: str = "stop") -> None:
        super().__init__()
        self.script, self.step, self.reason = script, step, reason

    async def generate(self, req: GenerateReq) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        pieces = [self.script[i:i + self.step] for i in range(0, len(self.script), self.step)] or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            lps = [{1000 + i: -0.5}] if req.params.logprobs is not None else None
            yield RequestOutput(piece, [1000 + i], self.reason if last else None, 5, i + 1, 0, lps)


def make_app(script: str, tool_parser: str | None = None, reasoning: str | None = None, **kw: Any):
    engine = ScriptedEngine(script, **kw)
    return build_app(engine, chat=chat_parsing(tool_parser, reasoning)), engine


def http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def openai_client(app: Any):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1",
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": ASK, **kw}


async def streamed(app: Any, **kw: Any) -> tuple[str, str, list[dict[str, Any]], list[str]]:
    """(reasoning, content, calls as assembled from their fragments, finish reasons) of a stream."""
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json=body(stream=True, **kw))
    assert r.status_code == 200, r.text
    reasoning, content, calls, finishes = "", "", {}, []
    for event in sse_events(r.text):
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for frag in delta.get("tool_calls") or ():
                call = calls.setdefault(frag["index"], {"id": None, "name": "", "arguments": ""})
                if "id" in frag:
                    assert frag["id"].startswith("call_") or len(frag["id"]) == 9 and frag["type"] == "function"
                    call["id"], call["name"] = frag["id"], frag["function"]["name"]
                call["arguments"] += frag["function"]["arguments"]
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return reasoning, content, [calls[i] for i in sorted(calls)], finishes


# ---- each format, whole and streamed --------------------------------------------------------------

@pytest.mark.parametrize("parser", sorted(OUTPUTS))
async def test_calls_whole_with_the_openai_client(parser) -> None:
    app, engine = make_app(OUTPUTS[parser], parser)
    async with openai_client(app) as client:
        done = await client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT[parser]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    # the tools reach the chat template; special-token markers are kept for the parsers that read them
    assert engine.requests[0].tools == TOOLS
    assert engine.requests[0].params.skip_special_tokens is (parser not in ("internlm", "mistral"))
    assert engine.requests[0].params.guide is None  # auto: nothing constrains the output


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("parser", sorted(OUTPUTS))
async def test_calls_streamed_add_up_to_the_whole(parser, step) -> None:
    app, _ = make_app(OUTPUTS[parser], parser, step=step)
    reasoning, content, calls, finishes = await streamed(app, tools=TOOLS)
    assert content == (CONTENT[parser] or "") and reasoning == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert finishes == ["tool_calls"]


async def test_streamed_with_the_openai_client() -> None:
    app, _ = make_app(OUTPUTS["hermes"], "hermes", step=2)
    async with openai_client(app) as client:
        stream = await client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, stream=True)
        got = gather([chunk async for chunk in stream])
        names, args, finishes = got.names, got.arguments, got.finishes
    assert names == {0: "get_weather", 1: "get_time"} and json.loads(args[0]) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


async def test_plain_text_with_tools_is_content_and_stops() -> None:
    app, _ = make_app("Paris is sunny today.", "hermes")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS))).json()
    choice = r["choices"][0]
    assert choice["message"]["content"] == "Paris is sunny today." and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    _, content, calls, finishes = await streamed(app, tools=TOOLS)
    assert (content, calls, finishes) == ("Paris is sunny today.", [], ["stop"])


async def test_a_call_cut_by_length_keeps_length() -> None:
    app, _ = make_app(OUTPUTS["hermes"], "hermes", reason="length")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS))).json()
    assert r["choices"][0]["finish_reason"] == "length" and len(r["choices"][0]["message"]["tool_calls"]) == 2


async def test_parallel_tool_calls_false_returns_one_call() -> None:
    app, _ = make_app(OUTPUTS["hermes"], "hermes")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS, parallel_tool_calls=False))).json()
    assert [c["function"]["name"] for c in r["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    _, _, calls, _ = await streamed(app, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in calls] == ["get_weather"]


async def test_tool_choice_none_renders_tools_but_parses_nothing() -> None:
    app, engine = make_app(OUTPUTS["hermes"], "hermes")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS, tool_choice="none"))).json()
    message = r["choices"][0]["message"]
    assert message["content"] == OUTPUTS["hermes"] and "tool_calls" not in message
    assert r["choices"][0]["finish_reason"] == "stop" and engine.requests[0].tools == TOOLS


# ---- reasoning ---------------------------------------------------------------------------------

THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"


@pytest.mark.parametrize("reasoner, script", [
    ("qwen3", THOUGHT + "It is sunny."),
    ("deepseek_r1", THOUGHT[len("<think>"):] + "It is sunny."),  # the template opened <think>
])
async def test_reasoning_split_whole_and_streamed(reasoner, script) -> None:
    app, _ = make_app(script, None, reasoner, step=2)
    async with openai_client(app) as client:
        done = await client.chat.completions.create(model="fake-model", messages=ASK)
    message = done.choices[0].message
    assert message.reasoning_content == "\nThe user wants the weather.\n"  # the openai client keeps extra fields
    assert message.content == "\n\nIt is sunny." and done.choices[0].finish_reason == "stop"
    reasoning, content, calls, finishes = await streamed(app)
    assert (reasoning, content, calls, finishes) == ("\nThe user wants the weather.\n", "\n\nIt is sunny.", [],
                                                     ["stop"])


async def test_qwen3_without_thinking_is_all_content() -> None:
    app, _ = make_app("It is sunny.", None, "qwen3")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body())).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.", "reasoning_content": None}


@pytest.mark.parametrize("step", [1, 5])
async def test_reasoning_then_tool_calls(step) -> None:
    script = THOUGHT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    app, _ = make_app(script, "hermes", "qwen3", step=step)
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS))).json()
    message = r["choices"][0]["message"]
    assert message["reasoning_content"] == "\nThe user wants the weather.\n" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    reasoning, content, calls, finishes = await streamed(app, tools=TOOLS)
    assert reasoning == "\nThe user wants the weather.\n" and content == ""
    assert [c["name"] for c in calls] == ["get_weather"] and finishes == ["tool_calls"]


async def test_logprobs_ride_on_the_chunks_that_are_sent() -> None:
    app, _ = make_app(OUTPUTS["hermes"], "hermes", step=4)
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json=body(tools=TOOLS, stream=True, logprobs=True))
    entries = [e for ev in sse_events(r.text) if ev != "[DONE]" for ch in ev["choices"]
               for e in ((ch.get("logprobs") or {}).get("content") or ())]
    assert len(entries) == -(-len(OUTPUTS["hermes"]) // 4)  # every token's, once


# ---- enforced choices --------------------------------------------------------------------------

@pytest.mark.parametrize("parser, kind", [("hermes", "hermes"), ("llama3_json", "bare"), ("mistral", "bare")])
async def test_required_and_named_are_a_grammar(parser, kind) -> None:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    app, engine = make_app("", parser)
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with http(app) as c:
        for choice in ("required", named):
            assert (await c.post("/v1/chat/completions", json=body(tools=TOOLS, tool_choice=choice))).status_code == 200
    required, named = (req.params.guide for req in engine.requests)
    assert required.kind == named.kind == "grammar"
    xgr.Grammar.from_ebnf(required.spec)
    key = "arguments" if kind == "hermes" else "parameters"

    def call(name: str, args: dict[str, Any]) -> str:
        text = json.dumps({"name": name, key: args})
        return f"<tool_call>\n{text}\n</tool_call>" if kind == "hermes" else text

    paris, now = call("get_weather", {"city": "Paris"}), call("get_time", {})
    joiner = "\n" if kind == "hermes" else "; "
    assert accepts(required.spec, paris) and accepts(required.spec, now)
    assert accepts(required.spec, paris + joiner + now)  # parallel calls allowed by default
    assert not accepts(required.spec, "Paris is sunny.")
    assert not accepts(required.spec, call("get_weather", {"town": "Paris"}))  # not the schema's properties
    assert not accepts(required.spec, call("get_weather", {"city": 3}))
    assert not accepts(required.spec, call("send_email", {}))
    assert accepts(named.spec, paris) and not accepts(named.spec, now)


async def test_an_enforced_call_is_parsed() -> None:
    # a non-hermes format's enforced output is the bare JSON call, read as llama3_json
    app, engine = make_app('{"name": "get_weather", "parameters": {"city": "Paris"}}', "mistral")
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS, tool_choice="required"))).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'


def test_parallel_false_grammar_takes_one_call() -> None:
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    params = (json.dumps(WEATHER["function"]["parameters"]),)
    one = calls_grammar(params, ("get_weather",), True, True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(one, call) and not accepts(one, call + "\n" + call)


def test_a_parameter_named_root_does_not_clash_with_the_grammar() -> None:
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    params = (json.dumps({"type": "object", "properties": {"root": {"type": "string"}}, "required": ["root"]}),)
    ebnf = calls_grammar(params, ("root",), False, True)
    assert accepts(ebnf, '{"name": "root", "parameters": {"root": "x"}}')


async def test_enforced_calls_need_no_known_format() -> None:
    # no --tool-call-parser and a template of no tool format: the grammar writes bare JSON calls
    app, engine = make_app('{"name": "get_weather", "parameters": {"city": "Paris"}}', None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body(tools=TOOLS, tool_choice=named))).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert engine.requests[0].params.guide.spec.startswith("root ::= tool_call")


# ---- refused -----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS}, "tools"),  # no --tool-call-parser and no known format: the 400 names the flag
])
async def test_tools_without_a_known_format_are_refused(extra, param) -> None:
    app, engine = make_app("x", None)
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=body(**extra)), 400)
    assert err["param"] == param and "--tool-call-parser" in err["message"] and not engine.requests


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "differ"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools", "JSON Schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools", ""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one of them"),
    ({"functions": [WEATHER["function"]]}, "functions", "tools"),
    ({"function_call": {"name": "get_weather"}}, "function_call", "tool_choice"),
])
async def test_bad_tool_requests_are_400s(extra, param, words) -> None:
    app, engine = make_app("x", "hermes")
    async with http(app) as c:
        err = assert_error(await c.post("/v1/chat/completions", json=body(**extra)), 400)
    assert param in (err["param"] or "") and words in err["message"] and not engine.requests


# ---- the history -------------------------------------------------------------------------------

async def test_tool_calls_and_results_in_the_history_reach_the_template() -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    app, engine = make_app("It is sunny.", "hermes")
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": "fake-model", "messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    sent = engine.requests[0].messages
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_the_default_parser_follows_the_template() -> None:
    from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES

    assert chat_parsing(None, None, CHAT_TEMPLATES["qwen3"]()).tool_parser == "hermes"
    assert chat_parsing(None, None, CHAT_TEMPLATES["llama3_1"]()).tool_parser == "llama3_json"
    assert chat_parsing(None, None, CHAT_TEMPLATES["chatml"]()).tool_parser is None
    assert chat_parsing("qwen", "qwen3", None) == ChatParsing("hermes", "qwen3", "--tool-call-parser")

    class Jinja:  # a model's own template: its markers tell
        name = "hf"
        tokenizer = type("T", (), {"chat_template": "{% if tools %}[TOOL_CALLS]{% endif %}"})()

    assert chat_parsing(None, None, Jinja()).tool_parser == "mistral"
    with pytest.raises(ValueError, match="hermes"):
        chat_parsing("nope")
    with pytest.raises(ValueError, match="deepseek_r1"):
        chat_parsing(None, "nope")


# ---- built-in templates against the published Jinja ---------------------------------------------

def _render_like_transformers(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """Render as transformers' apply_chat_template does (its tojson: non-ASCII kept, keys in order)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=True, bos_token="")


def test_qwen3_builtin_renders_tools_as_its_published_template() -> None:
    from test_chat_templates_families import QWEN3

    from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES

    chat = [{"role": "system", "content": "You are terse."}, *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    builtin = CHAT_TEMPLATES["qwen3"]()
    for messages in (ASK, chat, chat[1:]):
        assert builtin.messages2prompt(messages, tools=TOOLS) == _render_like_transformers(QWEN3, messages, TOOLS)
    # a history of calls without tools in the request renders too; a template with no tool format refuses
    assert "<tool_response>\nsunny\n</tool_response>" in builtin.messages2prompt(chat)
    with pytest.raises(ValueError, match="cannot render tools.*qwen3"):
        CHAT_TEMPLATES["chatml"]().messages2prompt(ASK, tools=TOOLS)


async def test_a_template_that_opens_thinking_starts_the_output_in_reasoning() -> None:
    class OpensThinking:  # QwQ / Qwen3-*-Thinking-2507: the generation prompt ends inside <think>
        name = "hf"

        def messages2prompt(self, messages: Any) -> str:
            return "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n"

    chat = chat_parsing(None, "qwen3", OpensThinking())
    assert chat.generation_prompt.endswith("<think>\n")
    app = build_app(ScriptedEngine("Sunny, surely.\n</think>\n\nIt is sunny.", step=2), chat=chat)
    async with http(app) as c:
        r = (await c.post("/v1/chat/completions", json=body())).json()
    assert r["choices"][0]["message"]["reasoning_content"] == "Sunny, surely.\n"
    assert r["choices"][0]["message"]["content"] == "\n\nIt is sunny."
    reasoning, content, _, _ = await streamed(app)
    assert (reasoning, content) == ("Sunny, surely.\n", "\n\nIt is sunny.")


# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json "chat_template" (its strftime_now date
# branch and comments left out: the built-in writes the template's default date; one long
# expression split in two lines inside its tag, which renders the same).
LLAMA3_1 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim +
            '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def test_llama3_1_builtin_renders_tools_as_its_published_template() -> None:
    from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES

    chat = [{"role": "system", "content": "You are terse."}, *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    builtin = CHAT_TEMPLATES["llama3_1"]()
    for messages in (ASK, chat, chat[1:]):
        assert builtin.messages2prompt(messages, tools=TOOLS) == _render_like_transformers(LLAMA3_1, messages, TOOLS)
    with pytest.raises(ValueError, match="one tool call"):
        builtin.messages2prompt([*ASK, {"role": "assistant", "content": "", "tool_calls": chat[2]["tool_calls"] * 2}])


@pytest.mark.parametrize("flag, known", [("--tool-call-parser", "hermes"), ("--reasoning-parser", "deepseek_r1")])
def test_an_unknown_parser_stops_the_server_at_start(flag, known, capsys) -> None:
    from conveyor.cli import main

    # refused before any stage starts (or the model is read): exit 2, the message lists the known names
    assert main(["serve", "api_server", "--server-name", "127.0.0.1", "--server-port", "0", flag, "nope"]) == 2
    assert known in capsys.readouterr().err

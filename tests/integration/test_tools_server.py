"""Tool calling on a real server (SmolLM2, ``--tool-call-parser hermes``) with the openai client.

SmolLM2-135M was never taught a tool format, so what it calls is up to the grammar: under
``tool_choice: "required"`` or a named function the output can only be calls whose arguments
match the function's ``parameters``, which is what these tests check (parsed by the server,
validated here with ``jsonschema``), streamed and not. ``tool_choice: "none"`` is plain text.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conveyor.testing.openai_stream import gather
from conveyor.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount of money",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "to": {"type": "string", "enum": ["EUR", "USD"]}},
        "required": ["amount", "to"], "additionalProperties": False}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MODEL = "SmolLM2-135M-Instruct"  # the served name: the model folder's
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    srv = ServerProcess(smollm2_dir, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                        "--cache-max-entry-count", "128",
                        "--cache-block-seq-len", "16", "--session-len", "1024",
                        log_dir=tmp_path_factory.mktemp("tools-server"))
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _whole(client, choice) -> tuple[str, str]:
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                          parallel_tool_calls=False, temperature=0, max_tokens=120)
    out = done.choices[0]
    assert out.finish_reason == "tool_calls", out
    assert len(out.message.tool_calls) == 1 and out.message.content is None
    call = out.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, call.function.arguments


def _streamed(client, choice) -> tuple[str, str]:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True)
    got = gather(stream)
    assert got.finishes == ["tool_calls"] and list(got.names) == [0] and got.content == ""
    return got.names[0], got.arguments[0]


def test_required_call_validates_streamed_and_whole(client):
    name, arguments = _whole(client, "required")
    _valid(name, arguments, set(SCHEMAS))
    assert _streamed(client, "required") == (name, arguments)  # greedy: the same call either way


def test_named_function_is_the_one_called(client):
    name, arguments = _whole(client, {"type": "function", "function": {"name": "convert"}})
    _valid(name, arguments, {"convert"})


def test_tool_choice_none_is_text(client):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    out = done.choices[0]
    assert out.message.content and not out.message.tool_calls and out.finish_reason in ("stop", "length")


def test_a_named_function_that_is_not_a_tool_is_a_400_and_the_server_serves_on(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content


# SmolLM2 does not think; a regex makes it write a think block, so the server's qwen3 reasoning
# parser has something to split (an output without one stays all content, as above).
THINKING = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,4}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\."


def test_reasoning_is_split_from_the_content(client):
    import re

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=80,
              extra_body={"guided_regex": THINKING})
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra.get("reasoning_content")
    assert re.fullmatch(r"\n[a-z]{2,8}( [a-z]{2,8}){1,4}\n", reasoning), reasoning
    assert re.fullmatch(r"\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\.", whole.message.content), whole.message.content
    streamed = gather(client.chat.completions.create(stream=True, **kw))
    assert (streamed.reasoning, streamed.content) == (reasoning, whole.message.content)

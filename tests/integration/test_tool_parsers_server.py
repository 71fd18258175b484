"""Each ``--tool-call-parser`` on a real server (SmolLM2), read with the openai client.

SmolLM2 prints no tool format of its own, so a grammar (``guided_grammar``, one literal) makes it
print a call in the server's format under ``tool_choice: "auto"``, exactly as a model trained on
that format would; the server must hand it back as ``tool_calls`` with ``finish_reason:
"tool_calls"``, whole and streamed alike, and the text before the call as content. (hermes is
covered with grammar-enforced choices in test_tools_server.py; how each format's markers come
through a tokenizer that makes them special tokens is test_tool_parsers_tokenized.py.)
"""

from __future__ import annotations

import json

import openai
import pytest

from conveyor.testing.openai_stream import gather
from conveyor.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

ARGS = {"city": "Paris", "days": 3}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
PRINTED = {
    "llama3_json": ('{"name": "get_weather", "parameters": %s}' % json.dumps(ARGS), None),
    "internlm": ('Let me look.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": %s}<|action_end|>'
                 % json.dumps(ARGS), "Let me look."),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": %s}]' % json.dumps(ARGS), None),
}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=sorted(PRINTED))
def served(request, smollm2_dir, tmp_path_factory):
    srv = ServerProcess(smollm2_dir, "--tool-call-parser", request.param, "--cache-max-entry-count", "64",
                        "--cache-block-seq-len", "16", "--session-len", "1024",
                        log_dir=tmp_path_factory.mktemp(f"parser-{request.param}"))
    yield request.param, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    assert srv.terminate() == 0, srv.log()


def test_a_printed_call_comes_back_as_tool_calls(served):
    parser, client = served
    text, content = PRINTED[parser]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              temperature=0, max_tokens=120, extra_body={"guided_grammar": "root ::= " + json.dumps(text)})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert (whole.message.content or None) == content
    [call] = whole.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS

    streamed = gather(client.chat.completions.create(stream=True, **kw))
    assert streamed.finishes == ["tool_calls"] and streamed.names == {0: "get_weather"}
    assert json.loads(streamed.arguments[0]) == ARGS
    assert (streamed.content or None) == content

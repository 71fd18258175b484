"""Tool-call parsers: each format's samples as the models print them, parsed whole and streamed.

Every sample is checked three ways: ``parse`` against the expected content and calls written out
by hand, and the streamed fragments (every split point into two deltas, one character at a
time, seeded random chunkings) against ``parse``: the concatenated content, and per call index
the id and name on the first fragment and the concatenated arguments.
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from text_chunkings import chunkings

from conveyor.protocol.errors import InvalidRequestError
from conveyor.services.ingress.tool_parsers import (
    TOOL_PARSERS,
    CallDelta,
    ContentDelta,
    JsonEnd,
    ToolCall,
    default_tool_parser,
    finish_reason,
    held_suffix,
    json_end,
    make_tool_parser,
    tool_parser_for_template_text,
)


def _call(name: str, **args) -> tuple[str, str]:
    return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))


WEATHER = '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
WEATHER_CALL = _call("get_current_weather", location="San Francisco, CA", unit="fahrenheit")
TIME = '{"name": "get_time", "arguments": {}}'
TIME_CALL = _call("get_time")
SEARCH = '{"name": "web_search", "arguments": {"query": "vLLM \\"tool\\" parsers {}", "top_k": 3}}'
SEARCH_CALL = _call("web_search", query='vLLM "tool" parsers {}', top_k=3)


def _hermes(*bodies: str) -> str:
    return "".join(f"<tool_call>\n{body}\n</tool_call>" for body in bodies)


def _plugin(body: str) -> str:
    return f"<|action_start|><|plugin|>\n{body}<|action_end|>"


# (format, model output, expected content, expected [(name, arguments)])
SAMPLES = [
    # ---- hermes (Hermes 2 Pro / 3, Qwen2.5, Qwen3) ----
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "", None, []),
    ("hermes", _hermes(WEATHER), None, [WEATHER_CALL]),
    ("hermes", "I'll check the weather for you.\n" + _hermes(WEATHER),
     "I'll check the weather for you.", [WEATHER_CALL]),
    ("hermes", _hermes(WEATHER) + "\n" + _hermes(TIME), None, [WEATHER_CALL, TIME_CALL]),
    ("hermes", _hermes(WEATHER) + "\n" + _hermes(TIME) + "\n" + _hermes(SEARCH) + "\n",
     None, [WEATHER_CALL, TIME_CALL, SEARCH_CALL]),
    ("hermes", "\n\n" + _hermes(TIME), None, [TIME_CALL]),  # Qwen3 after its </think>
    ("hermes", "Sure.\n" + _hermes(TIME) + "\nAnything else?", "Sure.\nAnything else?", [TIME_CALL]),
    ("hermes", _hermes('{"name": "translate", "arguments": {"text": "Zürich ☀ 東京", "to": "fr"}}'),
     None, [_call("translate", text="Zürich ☀ 東京", to="fr")]),
    ("hermes", _hermes('{"name": "greet", "arguments": {"who": "Ren\\u00e9e"}}'), None, [_call("greet", who="Renée")]),
    ("hermes", _hermes('{"name": "f", "arguments": "{\\"x\\": 1}"}'), None, [_call("f", x=1)]),  # double-encoded
    ("hermes", _hermes('{"name": "f"}'), None, [_call("f")]),  # no arguments: {}
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [TIME_CALL]),  # cut before the end tag
    # not calls: stay content, marker text included
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ("hermes", "Wrap it in <tool> or <tool_cal tags; x < y.", "Wrap it in <tool> or <tool_cal tags; x < y.", []),
    ("hermes", "ends with a partial <tool_ca", "ends with a partial <tool_ca", []),
    ("hermes", "A " + _hermes("{bad json}") + " B\n" + _hermes(TIME),
     "A <tool_call>\n{bad json}\n</tool_call> B", [TIME_CALL]),
    ("hermes", "answer\n", "answer\n", []),
    # ---- llama3_json (Llama 3.1 / 3.2 / 3.3) ----
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [_call("get_weather", city="Paris")]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [_call("get_weather", city="Paris")]),
    ("llama3_json", '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [_call("get_weather", city="Paris")]),  # Llama 3.2's habit
    ("llama3_json", '{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {"y": [1, 2]}}',
     None, [_call("a", x=1), _call("b", y=[1, 2])]),
    ("llama3_json", '{"name": "a", "parameters": {}};{"name": "b", "parameters": {}} ; '
                    '{"name": "c", "parameters": {"s": "é;}"}}',
     None, [_call("a"), _call("b"), _call("c", s="é;}")]),
    ("llama3_json", '\n{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}\n',
     None, [_call("a"), _call("b")]),
    ("llama3_json", '{"name": "a", "parameters": {}}\n\nHere you go.', "\n\nHere you go.", [_call("a")]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops": 1}', '; {"oops": 1}', [_call("a")]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),  # cut
    ("llama3_json", 'The JSON is {"name": "a", "parameters": {}}', 'The JSON is {"name": "a", "parameters": {}}', []),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")", []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", "  ", None, []),
    # ---- internlm (InternLM2 / 2.5 / 3) ----
    ("internlm", "Hello! How can I help?", "Hello! How can I help?", []),
    ("internlm", "I need to search for this."
     + _plugin('{"name": "web_search", "parameters": {"query": "InternLM2.5"}}') + "\n",
     "I need to search for this.", [_call("web_search", query="InternLM2.5")]),
    ("internlm", _plugin('{"name": "get_weather", "parameters": {"city": "北京"}}'),
     None, [_call("get_weather", city="北京")]),
    ("internlm", _plugin('{"name": "a", "parameters": {}}') + "\n" + _plugin('{"name": "b", "parameters": {"n": 2}}'),
     None, [_call("a"), _call("b", n=2)]),
    ("internlm", '<|action_start|><|interpreter|>\nprint(1)<|action_end|>',
     '<|action_start|><|interpreter|>\nprint(1)<|action_end|>', []),
    ("internlm", '<|action_start|><|plugin|>\n{"name": "a", "parameters": }<|action_end|>',
     '<|action_start|><|plugin|>\n{"name": "a", "parameters": }<|action_end|>', []),
    # ---- mistral ----
    ("mistral", "Bonjour !", "Bonjour !", []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}]",
     None, [WEATHER_CALL]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}, '
                '{"name": "c", "arguments": {"t": "ü"}}]',
     None, [_call("a", x=1), _call("b"), _call("c", t="ü")]),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Let me check.", [TIME_CALL]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [_call("get_weather", city="Paris")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     None, [_call("get_weather", city="Paris"), TIME_CALL]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}', None, [_call("add", a=3.5, b=4)]),  # [ARGS] skipped
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}]',
     '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}]', []),
    ("mistral", '[TOOL_CALLS]not a call', '[TOOL_CALLS]not a call', []),
    ("mistral", '[TOOL_CALLS][]', '[TOOL_CALLS][]', []),
    ("mistral", '[TOOL_CALLS]oops [TOOL_CALLS]f[ARGS]{"k": null}', "[TOOL_CALLS]oops", [_call("f", k=None)]),
    ("mistral", 'Use [TOOL_ to mark', 'Use [TOOL_ to mark', []),
]
# the id a [CALL_ID] carries is the call's id
MISTRAL_CALL_ID = '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}'


def _ids(samples):
    return [f"{fmt}-{i}" for i, (fmt, *_rest) in enumerate(samples)]


def _stream(name: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed chunks; (content, [(name, arguments)] per index, ids), checking the fragments' shape."""
    parser = make_tool_parser(name)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    content, calls, ids = "", [], []
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text, "an empty content fragment"
            content += d.text
        else:
            assert isinstance(d, CallDelta)
            if d.index == len(calls):  # the first fragment of a call carries its id and name
                assert d.id and d.name
                calls.append([d.name, d.arguments])
                ids.append(d.id)
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[-1][1] += d.arguments
    assert [(c.name, c.arguments) for c in parser.calls] == [tuple(c) for c in calls]
    assert parser.has_calls == bool(calls)
    return content, [tuple(c) for c in calls], ids


@pytest.mark.parametrize("fmt, text, content, calls", SAMPLES, ids=_ids(SAMPLES))
def test_parse(fmt, text, content, calls):
    got_content, got_calls = make_tool_parser(fmt).parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for call in got_calls:
        json.loads(call.arguments)  # always JSON text


@pytest.mark.parametrize("fmt, text, content, calls", SAMPLES, ids=_ids(SAMPLES))
def test_stream_equals_parse_for_any_chunking(fmt, text, content, calls):
    want_content, want_calls = make_tool_parser(fmt).parse(text)
    want = (want_content, [(c.name, c.arguments) for c in want_calls])
    for chunks in chunkings(text, seed=len(text)):
        got_content, got_calls, ids = _stream(fmt, chunks)
        assert (got_content if got_content.strip() else None, got_calls) == want, chunks
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("fmt", ["hermes", "internlm", "mistral"])
def test_content_before_a_marker_streams_at_once(fmt):
    parser = make_tool_parser(fmt)
    assert parser.feed("Let me look") == [ContentDelta("Let me look")]
    start = {"hermes": "<tool_call>", "internlm": "<|action_start|><|plugin|>", "mistral": "[TOOL_CALLS]"}[fmt]
    # a possible marker start is held back, never leaked ...
    assert parser.feed(" that up." + start[:-1]) == [ContentDelta(" that up.")]
    # ... and so is an open call, until its JSON is complete
    body = '{"name": "f", "arguments": {"q": 1}}' if fmt != "mistral" else '[{"name": "f", "arguments": {"q": 1}}'
    assert parser.feed(start[-1:] + body) == []
    rest = {"hermes": "</tool_call>", "internlm": "<|action_end|>", "mistral": "]"}[fmt]
    [delta] = parser.feed(rest)
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"q":1}')
    assert parser.finish() == []


def test_llama_holds_until_it_knows_the_output_is_not_a_call():
    parser = make_tool_parser("llama3_json")
    assert parser.feed("  ") == []
    assert parser.feed("<|python_") == []
    assert parser.feed("tag|>") == []
    assert parser.feed('{"name": "f", "parameters": {"a": ') == []
    [delta] = parser.feed('"x"}}')
    assert (delta.name, delta.arguments) == ("f", '{"a":"x"}')
    text = make_tool_parser("llama3_json")
    assert text.feed("Hello") == [ContentDelta("Hello")]
    assert text.feed(" {") == [ContentDelta(" {")]


def test_ids_look_like_openai_and_mistral():
    [call] = make_tool_parser("hermes").parse(_hermes(TIME))[1]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    [call] = make_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # Mistral's templates refuse other ids
    [call] = make_tool_parser("mistral").parse(MISTRAL_CALL_ID)[1]
    assert call.id == "a1B2c3D4e"
    assert len({c.id for c in make_tool_parser("hermes").parse(_hermes(TIME, TIME, TIME))[1]}) == 3


def test_openai_shapes():
    call = ToolCall("call_x", "f", '{"a":1}')
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    first = CallDelta(0, "", "call_x", "f")
    assert first.to_openai() == {"index": 0, "id": "call_x", "type": "function",
                                 "function": {"name": "f", "arguments": ""}}
    assert CallDelta(0, '{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}


def test_finish_reason():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason(None, True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"  # the last call may be cut: say so


def test_parse_leaves_the_stream_state_alone():
    parser = make_tool_parser("hermes")
    parser.feed("Hi <tool_")
    assert parser.parse(_hermes(TIME))[1][0].name == "get_time"
    assert parser.calls == []
    assert parser.feed('call>{"name": "g"}</tool_call>')[0].name == "g"


def test_deeply_nested_json_is_content_not_a_crash():
    text = "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"
    assert make_tool_parser("hermes").parse(text) == (text, [])
    text = '[TOOL_CALLS]' + "[" * 5000 + "]" * 5000
    assert make_tool_parser("mistral").parse(text) == (text, [])


def test_helpers():
    assert held_suffix("abc<too", "<tool_call>") == 4
    assert held_suffix("abc", "<tool_call>") == 0
    assert held_suffix("<tool_call", "<tool_call>") == 10
    assert json_end('x{"a": "}]", "b": [1, {}]} tail', 1) == len('x{"a": "}]", "b": [1, {}]}')
    assert json_end('{"a": "\\"}"', 0) is None
    assert json_end("[1, [2]", 0) is None


def test_registry_and_errors():
    assert set(TOOL_PARSERS) == {"llama3_json", "hermes", "internlm", "mistral"}
    for name in TOOL_PARSERS:
        assert make_tool_parser(name).name == name
    with pytest.raises(InvalidRequestError, match="choose one of hermes, internlm, llama3_json, mistral"):
        make_tool_parser("pythonic")
    with pytest.raises(ValueError):
        make_tool_parser("")
    # the formats whose markers are special tokens need the detokenizer to keep them
    assert make_tool_parser("mistral").needs_special_tokens and make_tool_parser("internlm").needs_special_tokens
    assert not make_tool_parser("hermes").needs_special_tokens
    assert not make_tool_parser("llama3_json").needs_special_tokens  # its JSON parses without the tag
    assert make_tool_parser("mistral").markers[0] == "[TOOL_CALLS]"
    # LMDeploy's names for the same formats
    assert make_tool_parser("qwen").name == make_tool_parser("qwen2d5").name == "hermes"
    assert make_tool_parser("llama3").name == "llama3_json"


@pytest.mark.parametrize("key, parser", [
    ("llama3", "llama3_json"), ("llama3_1", "llama3_json"), ("llama3_2", "llama3_json"),
    ("qwen", "hermes"), ("qwen2", "hermes"), ("qwen3", "hermes"),
    ("internlm2", "internlm"), ("internlm3", "internlm"), ("mistral", "mistral"), ("mixtral", "mistral"),
    ("Qwen2ForCausalLM", "hermes"), ("Qwen3ForCausalLM", "hermes"), ("Qwen3MoeForCausalLM", "hermes"),
    ("InternLM2ForCausalLM", "internlm"), ("MistralForCausalLM", "mistral"), ("MixtralForCausalLM", "mistral"),
    ("LlamaForCausalLM", None), ("llama2", None), ("vicuna", None), ("base", None), ("hf", None), ("", None),
    (None, None), ("gemma", None),
])
def test_default_tool_parser(key, parser):
    assert default_tool_parser(key) == parser


def test_default_names_are_builtin_templates():
    from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES
    from conveyor.services.ingress.tool_parsers import _BY_TEMPLATE
    assert set(_BY_TEMPLATE) <= set(CHAT_TEMPLATES)


def test_tool_parser_for_template_text():
    assert tool_parser_for_template_text("{% if tools %}<tool_call>\n{{ t }}</tool_call>{% endif %}") == "hermes"
    assert tool_parser_for_template_text("{% for tool in tools %}[TOOL_CALLS]{% endfor %}") == "mistral"
    assert tool_parser_for_template_text("{%- if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert tool_parser_for_template_text("{{ '<|im_start|>' + m.content }}") is None
    assert tool_parser_for_template_text(None) is None


def test_json_end_resumes_across_deltas():
    rng = random.Random(7)
    text = 'x[{"a": "b\\"]}", "c": [1, {"d": "\\\\"}]}, "e{"]  tail'
    whole = json_end(text, 1)
    assert text[1:whole] == '[{"a": "b\\"]}", "c": [1, {"d": "\\\\"}]}, "e{"]'
    json.loads(text[1:whole])
    for _ in range(50):
        scanner, got, i = JsonEnd(), None, 1
        while got is None and i < len(text):
            i += rng.randint(1, 5)
            got = scanner.find(text[:i], 1)
        assert got == whole


@pytest.mark.parametrize("fmt, wrap", [
    ("hermes", lambda body: f"<tool_call>\n{body}\n</tool_call>"),
    ("llama3_json", lambda body: body),
    ("mistral", lambda body: f"[TOOL_CALLS][{body}]"),
    ("internlm", _plugin),
])
def test_a_long_call_streams_in_linear_time(fmt, wrap):
    # 200 KB of arguments in 4-character deltas: a rescan per delta would take minutes
    content = "def f(x):\n    return {'k': [x, \"}\"]}\n" * 5000
    text = wrap(json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": content}}))
    parser = make_tool_parser(fmt)
    began = time.perf_counter()
    for i in range(0, len(text), 4):
        parser.feed(text[i:i + 4])
    parser.finish()
    assert time.perf_counter() - began < 5
    [call] = parser.calls
    assert json.loads(call.arguments)["content"] == content

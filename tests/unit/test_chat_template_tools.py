"""The built-in InternLM2 and Mistral templates render tools as those families were trained to read them.

InternLM2's tokenizers ship no Jinja for tools: the reference is InternLM's chat/chat_format.md, whose
function-call example is written out below. Mistral's is the chat_template of
mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json, rendered with jinja2 as transformers does.
Each rendered call, printed by the model, parses back with the family's tool-call parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from conveyor.services.ingress.tool_parsers import make_tool_parser
from conveyor.services.tokenizer.chat_template import CHAT_TEMPLATES

TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string"}}, "required": ["location"]}}}]
ASK = [{"role": "user", "content": "I want to know today's weather in Shanghai"}]


def _call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    # arguments as OpenAI clients send them: JSON text
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# ---- InternLM2 ----------------------------------------------------------------------------------

def test_internlm2_renders_the_documented_function_call() -> None:
    chat = [{"role": "system", "content": "You are InternLM2-Chat, a harmless AI assistant"}, *ASK,
            {"role": "assistant", "content": "Sure, I will search for the weather of Shanghai.",
             "tool_calls": [_call("c1", "get_current_weather", location="Shanghai")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 22}'}]
    listing = json.dumps([TOOLS[0]["function"]], ensure_ascii=False)
    assert CHAT_TEMPLATES["internlm2"]().messages2prompt(chat, tools=TOOLS) == (
        "<|im_start|>system\nYou are InternLM2-Chat, a harmless AI assistant<|im_end|>\n"
        f"<|im_start|>system name=<|plugin|>\n{listing}<|im_end|>\n"
        "<|im_start|>user\nI want to know today's weather in Shanghai<|im_end|>\n"
        "<|im_start|>assistant\nSure, I will search for the weather of Shanghai.<|action_start|><|plugin|>\n"
        '{"name": "get_current_weather", "parameters": {"location": "Shanghai"}}<|action_end|><|im_end|>\n'
        "<|im_start|>environment name=<|plugin|>\n{\"temperature\": 22}<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_internlm2_tools_follow_its_default_system_prompt() -> None:
    template = CHAT_TEMPLATES["internlm2"]()
    prompt = template.messages2prompt(ASK, tools=TOOLS)
    assert prompt.startswith(f"<|im_start|>system\n{template.meta_instruction}<|im_end|>\n"
                             "<|im_start|>system name=<|plugin|>\n[{")
    assert prompt.endswith("<|im_end|>\n<|im_start|>user\nI want to know today's weather in Shanghai<|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_internlm2_parallel_calls_and_results_are_each_their_own_block() -> None:
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        _call("a", "get_current_weather", location="Shanghai"), _call("b", "get_current_weather", location="Paris")]},
        {"role": "tool", "tool_call_id": "a", "content": "22"}, {"role": "tool", "tool_call_id": "b", "content": "18"}]
    prompt = CHAT_TEMPLATES["internlm2"]().messages2prompt(chat)
    assert prompt.count("<|action_start|><|plugin|>\n") == 2
    assert prompt.endswith("<|im_start|>environment name=<|plugin|>\n22<|im_end|>\n"
                           "<|im_start|>environment name=<|plugin|>\n18<|im_end|>\n<|im_start|>assistant\n")


# ---- Mistral v0.3 -------------------------------------------------------------------------------

# mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json "chat_template" (its role-alternation check left out,
# one message split in two lines).
MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial "
                            ~ "optional system message!") }}
    {%- endif %}
{%- endfor %}
"""


def _jinja(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Rendered as transformers' apply_chat_template renders it (the call arguments decoded, as the
    chat template stage passes them; the BOS left to the tokenizer)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = fail
    def decoded(call: dict[str, Any]) -> dict[str, Any]:
        return {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}

    messages = [{**m, "tool_calls": [decoded(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in messages]
    kwargs = {} if tools is None else {"tools": tools}
    return env.from_string(MISTRAL_V03).render(messages=messages, bos_token="", eos_token="</s>", **kwargs)


LOOP = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    _call("a1B2c3D4e", "get_current_weather", location="Shanghai"), _call("Zz9Yy8Xx7", "get_current_weather")]},
    {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": '{"temperature": 22}'},
    {"role": "tool", "tool_call_id": "Zz9Yy8Xx7", "content": "unknown"}]
SYSTEM = {"role": "system", "content": "Answer in one sentence."}
CHATS = {
    "one question": ASK,
    "a system message": [SYSTEM, *ASK],
    "a tool loop": LOOP,
    "a tool loop, then a question": [*LOOP, {"role": "assistant", "content": "  It is 22 degrees.\n"},
                                     {"role": "user", "content": "And tomorrow?"}],
    "a system message, a tool loop, then a question": [SYSTEM, *LOOP, {"role": "assistant", "content": "22."},
                                                       {"role": "user", "content": "And tomorrow?"}],
}


@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "history only"])
@pytest.mark.parametrize("chat", CHATS.values(), ids=CHATS.keys())
def test_mistral_renders_tools_as_its_published_v0_3_template(chat, with_tools) -> None:
    tools = TOOLS if with_tools else None
    if not with_tools and not any(m.get("tool_calls") for m in chat):
        pytest.skip("a chat without tools or tool turns keeps LMDeploy's mistral layout")
    assert CHAT_TEMPLATES["mistral"]().messages2prompt(chat, tools=tools) == _jinja(chat, tools)


def test_mistral_keeps_the_system_message_while_a_tool_loop_runs() -> None:
    # the published Jinja writes the system message only when the chat ends on the last user turn;
    # mistral-common (Mistral's own tokenizer) puts it there always, as here
    prompt = CHAT_TEMPLATES["mistral"]().messages2prompt([SYSTEM, *LOOP], tools=TOOLS)
    assert "[/AVAILABLE_TOOLS][INST] Answer in one sentence.\n\nI want to know" in prompt
    assert prompt == _jinja([SYSTEM, *LOOP], TOOLS).replace("[INST] I want", "[INST] Answer in one sentence.\n\nI want")


def test_mistral_maps_other_call_ids_to_nine_characters_the_same_way_for_the_result() -> None:
    chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": [_call("call_0123456789abcdef", "f")]},
            {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "ok"},
            {"role": "assistant", "content": "", "tool_calls": [_call("x", "g")]},
            {"role": "tool", "tool_call_id": "x", "content": "ok"}]
    prompt = CHAT_TEMPLATES["mistral"]().messages2prompt(chat)
    ids, call_ids = re.findall(r'"id": "([^"]*)"', prompt), re.findall(r'"call_id": "([^"]*)"', prompt)
    assert ids == call_ids and ids[0] == "789abcdef"  # the last nine
    assert re.fullmatch("[0-9a-f]{9}", ids[1])  # a digest of "x"


def test_mistral_without_tools_keeps_lmdeploys_layout() -> None:
    assert CHAT_TEMPLATES["mistral"]().messages2prompt([SYSTEM, *ASK]) == (
        "[INST] Answer in one sentence.\n\nI want to know today's weather in Shanghai [/INST]")


# ---- what the model prints back ------------------------------------------------------------------

@pytest.mark.parametrize("template, parser, turn_end", [
    ("internlm2", "internlm", "<|im_end|>\n"), ("mistral", "mistral", "</s>")])
def test_a_rendered_call_parses_back(template, parser, turn_end) -> None:
    calls = [_call("a1B2c3D4e", "get_current_weather", location="Shanghai", unit="celsius"),
             _call("b1B2c3D4e", "get_current_weather", location="Paris")]
    chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}]
    rendered = CHAT_TEMPLATES[template]().messages2prompt(chat, tools=TOOLS, add_generation_prompt=False)
    before = CHAT_TEMPLATES[template]().messages2prompt(ASK, tools=TOOLS)
    assert rendered.startswith(before) and rendered.endswith(turn_end)
    printed = rendered[len(before):-len(turn_end)]  # what the model wrote, its stop token aside
    content, parsed = make_tool_parser(parser).parse(printed)
    assert not content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

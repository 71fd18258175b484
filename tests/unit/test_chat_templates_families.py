# ruff: noqa: E501  (the published templates below are quoted verbatim, long lines included)
"""Issue 30's chat templates, each against its family's published format, string for string.

Where the family publishes a Jinja chat template (its tokenizer_config.json on the Hugging Face
hub), the template text is written below as a fixture and rendered with jinja2 the way transformers'
``apply_chat_template`` does (sandboxed, trim_blocks, lstrip_blocks); the built-in must give the
same string for a system message, two user turns with an answer between, and the generation prompt.
BOS-like prefixes (``bos_token``, ChatGLM's ``[gMASK]sop``) are left out on both sides: the
tokenizer adds those when it encodes, so the built-ins never write them.
Where no Jinja was published (InternLM v1, Baichuan2, ChatGLM2) the expected string is the format
of the model's own prompt-building code, cited at each case.
"""

from __future__ import annotations

from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conveyor.services.tokenizer.chat_template import (
    CHAT_TEMPLATES,
    ChatTemplateConfig,
    get_chat_template,
    list_chat_templates,
    template_for_model_name,
)

SYSTEM = [{"role": "system", "content": "You are terse."}]
TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Name a prime."},
]

# Qwen/Qwen3-8B tokenizer_config.json "chat_template" (the same in the other Qwen3 dense models).
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json "chat_template", its branches for tools
# (custom_tools, builtin_tools, ipython/tool messages, tool_calls) left out: those never run here.
LLAMA3_1 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# google/gemma-7b-it (and gemma-2-*-it) tokenizer_config.json "chat_template": no system role.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
         "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
         "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/"
         "user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' "
         "%}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
         "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\n'}}{% endif %}")

# google/gemma-3-*-it chat_template (text content only: its branch for a list of parts left out): the system
# message opens the first user turn.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# microsoft/Phi-3.5-mini-instruct (and the updated Phi-3-mini-*-instruct) "chat_template".
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' "
        "+ message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# THUDM/chatglm3-6b tokenizer_config.json "chat_template" (revision 103caa4, line 42).
CHATGLM3 = ("{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n "
            "{{ message['content'] }}{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

# THUDM/glm-4-9b-chat tokenizer_config.json "chat_template", its `item['tools']` branch left out.
GLM4 = ("[gMASK]<sop>{% for item in messages %}{% if item['content'] %}<|{{ item['role'] }}|>"
        "{{ item['metadata'] }}\n{{ item['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _render_jinja(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Render like transformers' apply_chat_template (tokenize=False, add_generation_prompt=True)."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    kwargs.setdefault("bos_token", "")
    kwargs.setdefault("eos_token", "</s>")
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **kwargs)


def _builtin(name: str, messages: list[dict[str, Any]]) -> str:
    return ChatTemplateConfig(name).to_template().messages2prompt(messages)


# (template name, published Jinja, prefix the Jinja writes that the tokenizer adds instead,
#  whether the family's template takes a system message)
JINJA_CASES = [
    ("qwen3", QWEN3, "", True),
    ("llama3_1", LLAMA3_1, "", True),
    ("llama3_2", LLAMA3_1, "", True),  # Llama-3.2-*-Instruct: the same template, other default date
    ("gemma", GEMMA3, "", True),
    ("gemma", GEMMA, "", False),
    ("phi-3", PHI3, "", True),
    ("chatglm3", CHATGLM3, "[gMASK]sop", True),
    ("glm4", GLM4, "[gMASK]<sop>", True),
]


@pytest.mark.parametrize(("name", "source", "prefix", "with_system"), JINJA_CASES)
def test_builtin_equals_published_jinja(name: str, source: str, prefix: str, with_system: bool) -> None:
    chats = [SYSTEM + TURNS, TURNS] if with_system else [TURNS]
    for messages in chats:
        expected = _render_jinja(source, messages)
        assert expected.startswith(prefix)
        assert _builtin(name, messages) == expected[len(prefix):]


def test_qwen3_matches_jinja_first_turn_and_no_default_system() -> None:
    first = [{"role": "user", "content": "Hi"}]
    assert _builtin("qwen3", first) == _render_jinja(QWEN3, first) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # Qwen (1/2/2.5) keeps its default system prompt; Qwen3 has none.
    assert "You are a helpful assistant." in _builtin("qwen", first)


def test_gemma_1_template_refuses_system_the_builtin_folds_it_like_gemma_3() -> None:
    with pytest.raises(TemplateError, match="System role"):
        _render_jinja(GEMMA, SYSTEM + TURNS)
    assert _builtin("gemma", SYSTEM + TURNS).startswith("<start_of_turn>user\nYou are terse.\n\nHi there")


# Families with no published Jinja template: the prompt their own code builds.
DOCUMENTED = {
    # internlm/internlm-chat-7b (v1.1) and internlm-chat-20b, modeling_internlm.py build_inputs:
    # "<|System|>:{meta}\n" then "<|User|>:{query}\n<|Bot|>:{response}<eoa>\n" per round.
    "internlm": ("<|System|>:You are terse.\n<|User|>:Hi there\n<|Bot|>:Hello, how can I help?<eoa>\n"
                 "<|User|>:Name a prime.\n<|Bot|>:"),
    # baichuan-inc/Baichuan2-7B-Chat generation_utils.py build_chat_input: system tokens, then
    # user_token_id (195, <reserved_106>) + query, assistant_token_id (196, <reserved_107>) + answer.
    "baichuan2": ("You are terse.<reserved_106>Hi there<reserved_107>Hello, how can I help?"
                  "<reserved_106>Name a prime.<reserved_107>"),
    # THUDM/chatglm2-6b modeling_chatglm.py build_prompt: "[Round {i}]\n\n问：{q}\n\n答：{r}\n\n";
    # it has no system role (the system text goes first, then a blank line: our choice).
    "chatglm2": ("You are terse.\n\n[Round 1]\n\n问：Hi there\n\n答：Hello, how can I help?\n\n"
                 "[Round 2]\n\n问：Name a prime.\n\n答："),
    # LMDeploy's falcon: no chat format, the text as is.
    "falcon": "You are terse.Hi thereHello, how can I help?Name a prime.",
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_builtin_equals_documented_format(name: str) -> None:
    assert _builtin(name, SYSTEM + TURNS) == DOCUMENTED[name]


def test_internlm_default_system_prompt() -> None:
    prompt = _builtin("internlm", [{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|System|>:You are an AI assistant whose name is InternLM")
    assert prompt.endswith("中文.\n\n<|User|>:Hi\n<|Bot|>:")


def test_chatglm2_first_turn_and_alias() -> None:
    assert _builtin("chatglm2", [{"role": "user", "content": "你好"}]) == "[Round 1]\n\n问：你好\n\n答："
    assert CHAT_TEMPLATES["chatglm"] is CHAT_TEMPLATES["chatglm2"]  # LMDeploy's name for it


@pytest.mark.parametrize(("name", "stops"), [
    ("internlm", ["<eoa>"]),
    ("baichuan2", ["</s>"]),
    ("chatglm2", ["</s>"]),
    ("chatglm3", ["<|user|>", "<|observation|>"]),
    ("glm4", ["<|user|>", "<|endoftext|>", "<|observation|>"]),
    ("gemma", ["<end_of_turn>"]),
    ("phi-3", ["<|end|>", "<|endoftext|>"]),
    ("llama3_1", ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]),
    ("qwen3", ["<|im_end|>", "<|endoftext|>"]),
])
def test_stop_words(name: str, stops: list[str]) -> None:
    template = CHAT_TEMPLATES[name]()
    assert set(stops) <= set(template.stop_words)
    # A turn the model ends at its stop word continues with the separator, never a half-eaten eoa
    # (ChatGLM2's "\n\n" after an answer is layout: its answers end with the EOS, </s>).
    if template.eoa and name != "chatglm2":
        assert template.eoa in template.stop_words


@pytest.mark.parametrize(("name", "expected"), [
    ("qwen3", "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"),
    ("gemma", "\n<start_of_turn>user\nnext<end_of_turn>\n<start_of_turn>model\n"),
    ("phi-3", "\n<|user|>\nnext<|end|>\n<|assistant|>\n"),
    ("chatglm3", "<|user|>\n next<|assistant|>"),
    ("glm4", "<|user|>\nnext<|assistant|>"),
    ("llama3_1", "<|start_header_id|>user<|end_header_id|>\n\nnext<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("internlm", "\n<|User|>:next\n<|Bot|>:"),
])
def test_later_turn_of_a_session(name: str, expected: str) -> None:
    template = CHAT_TEMPLATES[name]()
    assert template.get_prompt("next", sequence_start=False) == expected
    # The same text the whole chat adds after the previous answer's stop word.
    whole = template.messages2prompt(SYSTEM + TURNS[:2] + [{"role": "user", "content": "next"}])
    assert whole.endswith(expected)


@pytest.mark.parametrize(("path", "name"), [
    ("Qwen/Qwen3-8B", "qwen3"),
    ("/models/qwen3-0.6b", "qwen3"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3_1"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama3_1"),
    ("meta-llama/Llama-3.2-3B-Instruct", "llama3_1"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3"),
    ("internlm/internlm-chat-7b", "internlm"),
    ("internlm/internlm-chat-20b", "internlm"),
    ("internlm/internlm-7b", "base"),  # LMDeploy: only the chat models
    ("internlm/internlm2-chat-7b", "internlm2"),
    ("internlm/internlm3-8b-instruct", "internlm2"),  # LMDeploy's internlm3 is InternLM2's template
    ("baichuan-inc/Baichuan2-13B-Chat", "baichuan2"),
    ("baichuan-inc/Baichuan2-7B-Base", "base"),
    ("THUDM/chatglm2-6b", "chatglm2"),
    ("THUDM/chatglm3-6b", "chatglm3"),
    ("THUDM/glm-4-9b-chat", "glm4"),
    ("google/gemma-2-9b-it", "gemma"),
    ("google/gemma-7b-it", "gemma"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi-3"),
    ("microsoft/Phi-3.5-mini-instruct", "phi-3"),
    ("tiiuae/falcon-7b-instruct", "falcon"),
])
def test_match_from_path(path: str, name: str) -> None:
    assert get_chat_template(path).name == name


@pytest.mark.parametrize("name", ["internlm", "baichuan2", "chatglm2", "chatglm", "chatglm3", "glm4",
                                  "gemma", "phi-3", "falcon", "llama3_1", "llama3_2", "qwen3",
                                  "internlm3"])
def test_issue_30_names_are_registered(name: str) -> None:
    assert name in list_chat_templates()
    config = template_for_model_name(name)
    assert config is not None and config.model_name == name


def test_mixtral_is_mistrals_template_under_lmdeploys_name() -> None:
    """LMDeploy names Mixtral's template ``mixtral``: Mistral's prompt format."""
    assert "mixtral" in list_chat_templates()
    assert get_chat_template("mistralai/Mixtral-8x7B-Instruct-v0.1").name == "mistral"
    config = template_for_model_name("mixtral")
    assert config is not None
    messages = [{"role": "user", "content": "hi"}]
    assert config.to_template().messages2prompt(messages) == get_chat_template("mistral").messages2prompt(messages)

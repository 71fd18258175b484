"""Chat templates: turn a chat (or one user turn) into the prompt text a model was trained on.

Mirrors LMDeploy's ``ChatTemplateConfig`` / ``BaseChatTemplate``: a template is a set of strings
wrapped around each turn::

    {system}{meta_instruction}{eosys}{user}{user_content}{eoh}{assistant}{assistant_content}{eoa}{separator}{user}...

Built-in templates never contain the BOS token: the tokenizer adds it when encoding (LMDeploy's
llama3 puts ``<|begin_of_text|>`` in the text, which would double it with a HF tokenizer). Only
``HFChatTemplate`` may render a BOS, and then says so through ``includes_bos``.

Every template's ``messages2prompt`` takes the request's template options (``TemplateOptions``):
``add_generation_prompt`` (the prompt ends where the assistant speaks; false: after the last
message), ``continue_final_message`` (the prompt ends inside the last, assistant, message, which
the model continues) and ``chat_template_kwargs``, the extra variables a Jinja template reads
(Qwen3's ``enable_thinking``); a built-in template ignores the ones it does not know.

Tools (OpenAI's ``tools``, assistant messages with ``tool_calls``, ``tool`` messages) go to a
Jinja template as transformers passes them (``apply_chat_template(..., tools=...)``). Of the
built-in templates, the families trained on a tool format render it as their published
templates do (``tool_format`` names the parser that reads the calls back): Qwen2.5 / Qwen3
(Hermes ``<tool_call>``), Llama 3.1 / 3.2 (JSON calls, tools in the first user message),
InternLM2 / 3 (``<|plugin|>`` system and environment turns, as InternLM's chat format documents)
and Mistral (v0.3's ``[AVAILABLE_TOOLS]`` / ``[TOOL_CALLS]`` / ``[TOOL_RESULTS]``). Any other
built-in template refuses tools with a 400 naming those.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from ...protocol.errors import ConveyorError, InvalidRequestError

logger = logging.getLogger(__name__)

Capability = Literal["completion", "infilling", "chat", "python"]

CAPABILITIES = ("completion", "infilling", "chat", "python")
Messages = str | list[dict[str, Any]]

class UnknownChatTemplateError(ConveyorError, ValueError):
    """A chat template name that is neither built in nor defined by explicit fields."""


def _text(content: Any) -> str:
    """Content as a string; OpenAI multi-part content keeps its text parts only, joined by newlines
    (as the ingress and vLLM join them: every template path reads parts alike)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type", "text") == "text")
    raise TypeError(f"message content must be a str or a list of parts, got {type(content).__name__}")


# Names a chat_template_kwargs entry may not take: apply_chat_template's own parameters, the
# variables the template gets from the request itself, and the tokenizer's special tokens (a
# client overriding bos_token would change what the prompt starts with, unseen).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})
# Stands in for the last message's text while continue_final_message renders the chat: the
# prompt is cut where it appears (private-use characters: no real text carries them).
_CONTINUE_MARK = "\ue000conveyor-continue\ue000"


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` checked (a dict of identifier names, none reserved); raises
    InvalidRequestError naming the field to use instead."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object of template variables, e.g. "
                                  '{"enable_thinking": false}', param="chat_template_kwargs")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} is not a template variable name",
                                      param="chat_template_kwargs")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs: {name!r} is set by the request itself, not by a template variable "
                "(messages, add_generation_prompt and continue_final_message are the request's own fields; "
                "the chat template and its special tokens are the server's)", param="chat_template_kwargs")
    return kwargs


def _final_to_continue(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The last message, which continue_final_message continues: it must be the assistant's."""
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidRequestError("continue_final_message: the last message must be the assistant's (the text "
                                  "the model continues); or leave continue_final_message out", param="messages")
    return messages[-1]


def _cut_at_mark(rendered: str, final: dict[str, Any]) -> str:
    """The chat rendered with the mark for the last message's text, cut at the mark, followed by
    that text: the prompt ends inside the last message."""
    at = rendered.rfind(_CONTINUE_MARK)
    if at < 0:
        raise InvalidRequestError("continue_final_message: this chat template does not render the last "
                                  "assistant message's text; leave continue_final_message out", param="messages")
    return rendered[:at] + _text(final.get("content") or "")


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*messages[:-1], {**messages[-1], "content": _CONTINUE_MARK}]


@dataclass
class BaseChatTemplate:
    """A template built from LMDeploy's strings; with all defaults it returns the text as is."""

    system: str = ""
    meta_instruction: str | None = None  # default system prompt; None (not "") means none at all
    eosys: str = ""
    user: str = ""
    eoh: str = ""
    assistant: str = ""
    eoa: str = ""
    separator: str = ""
    capability: Capability | None = "chat"
    stop_words: list[str] = field(default_factory=list)

    name: ClassVar[str] = "base"
    # Lowercased substrings of a model name/path that select this template, and ones that rule it
    # out (a more specific family's: "qwen3" is not "qwen", "llama-3.1-" is not "llama3").
    match_patterns: ClassVar[tuple[str, ...]] = ()
    exclude_patterns: ClassVar[tuple[str, ...]] = ()
    # What ends a prompt where the assistant speaks, when it is not ``assistant`` (ChatGLM3 and
    # GLM-4 prompt with the bare ``<|assistant|>``; the model writes the newline itself).
    generation_prompt: ClassVar[str | None] = None
    # Models without a system role (llama2, mistral) put the system block inside the first user turn.
    system_in_user: ClassVar[bool] = False
    # True when the prompt already holds the BOS the tokenizer adds (encode with add_special_tokens=False).
    includes_bos: ClassVar[bool] = False
    # The tool-call format the template renders tools in (a tool-call parser's name); None: none.
    tool_format: ClassVar[str | None] = None

    @classmethod
    def match(cls, model_path: str) -> bool:
        """True when the lowercased model name or path contains one of ``match_patterns``."""
        lowered = model_path.lower()
        return (any(p in lowered for p in cls.match_patterns)
                and not any(p in lowered for p in cls.exclude_patterns))

    def _assistant_prompt(self) -> str:
        return self.assistant if self.generation_prompt is None else self.generation_prompt

    def get_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        """Prompt for one user turn; later turns of a session (sequence_start=False) get no system prompt."""
        if self.capability == "completion":
            return prompt
        if sequence_start:
            return self._render([{"role": "user", "content": prompt}])
        # The previous turn ended at the generated eoa, so only the separator is missing.
        return f"{self.separator}{self.user}{prompt}{self.eoh}{self._assistant_prompt()}"

    def messages2prompt(self, messages: Messages, sequence_start: bool = True, *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                        **template_kwargs: Any) -> str:
        """Prompt for a user string or an OpenAI-style message list, ending where the assistant
        speaks (``add_generation_prompt``), after the last message (not), or inside the last,
        assistant, message (``continue_final_message``). ``template_kwargs`` are the request's
        chat_template_kwargs: a built-in template reads the ones it knows and ignores the rest.
        ``tools`` are rendered in the template's ``tool_format``; a template without one refuses them."""
        if not isinstance(messages, str) and (tools or _has_tool_turns(messages)):
            return self._tool_prompt(messages, sequence_start, add_generation_prompt, continue_final_message,
                                     tools or None, template_kwargs)
        if isinstance(messages, str):
            text = self.get_prompt(messages, sequence_start)
        elif continue_final_message:
            final = _final_to_continue(messages)
            return _cut_at_mark(self._render(_marked(messages), sequence_start, generation_prompt=False), final)
        else:
            text = self._render(messages, sequence_start, generation_prompt=add_generation_prompt)
        return text + self._after_generation_prompt(template_kwargs) if add_generation_prompt else text

    def _tool_prompt(self, messages: list[dict[str, Any]], sequence_start: bool, add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any]) -> str:
        """``messages2prompt`` of a chat with tools or tool turns: the template's tool format
        rewrites the chat into turns the plain layout renders (``_with_tools``)."""
        if self.tool_format is None:
            raise InvalidRequestError(
                f"the chat template {self.name!r} cannot render tools (the request's tools, an assistant's "
                "tool_calls, messages of role 'tool'): serve the model with "
                f"--chat-template {' or '.join(TOOL_TEMPLATES)} if it was trained on that tool format, "
                "or use a model whose own Jinja chat template renders tools", param="tools")
        plain = self._with_tools(messages, tools, sequence_start)
        if continue_final_message:
            final = _final_to_continue(plain)
            return _cut_at_mark(self._render(_marked(plain), sequence_start, generation_prompt=False), final)
        text = self._render(plain, sequence_start, generation_prompt=add_generation_prompt)
        return text + self._after_generation_prompt(template_kwargs) if add_generation_prompt else text

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        """The chat with its tools, tool calls and tool results written as the format's text."""
        raise NotImplementedError

    def _after_generation_prompt(self, template_kwargs: dict[str, Any]) -> str:
        """What follows the generation prompt, given the request's chat_template_kwargs."""
        return ""

    def _render(self, messages: list[dict[str, Any]], sequence_start: bool = True,
                generation_prompt: bool = True) -> str:
        ret, pending = "", ""
        has_system = bool(messages) and messages[0].get("role") == "system"
        if sequence_start and self.meta_instruction is not None and not has_system:
            messages = [{"role": "system", "content": self.meta_instruction}, *messages]
        for msg in messages:
            role, content = msg.get("role"), _text(msg.get("content", ""))
            if role == "system":
                block = f"{self.system}{content}{self.eosys}"
                if self.system_in_user:
                    pending += block
                else:
                    ret += block
            elif role == "user":
                ret += f"{self.user}{pending}{content}{self.eoh}"
                pending = ""
            elif role == "assistant":
                ret += f"{self.assistant}{content}{self.eoa}{self.separator}"
            elif role == _RAW_ROLE:  # a turn _with_tools wrote whole in the format's own markers
                ret += content
            else:
                raise ValueError(f"unsupported message role {role!r}: use 'system', 'user' or 'assistant'")
        return f"{ret}{pending}{self._assistant_prompt() if generation_prompt else ''}"



# The role _with_tools gives a turn it wrote whole, markers included (a tool listing, a call or a
# result that the format frames in its own way): rendered as is, never a chat's role.
_RAW_ROLE = "\ue000raw-turn"


def _has_tool_turns(messages: Any) -> bool:
    """Whether a chat holds tool calls or tool results (which only a tool format renders)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


def _tojson(value: Any, indent: int | None = None) -> str:
    """Jinja's ``tojson`` as transformers' chat templates have it (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _call_parts(call: Any) -> tuple[str, Any]:
    """(name, arguments object) of an assistant message's tool call, OpenAI's shape or the bare
    function; arguments given as JSON text are decoded, as the published templates expect."""
    if not isinstance(call, dict):
        raise ValueError(f"a tool call must be an object, got {call!r:.100}")
    function = call.get("function", call)
    name, args = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str):
        raise ValueError(f"a tool call needs a function name, got {call!r:.100}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: rendered as the text it is
    return name, args


# Fields a ChatTemplateConfig may override on a template: the template's own, declared once above
# (ChatTemplateConfig restates them as optional fields, LMDeploy's API; a test keeps the two equal).
TEMPLATE_FIELDS = tuple(f.name for f in fields(BaseChatTemplate))
_TEXT_FIELDS = tuple(name for name in TEMPLATE_FIELDS if name not in ("capability", "stop_words"))

CHAT_TEMPLATES: dict[str, type[BaseChatTemplate]] = {}


def register_chat_template(
        name: str, *aliases: str) -> Callable[[type[BaseChatTemplate]], type[BaseChatTemplate]]:
    """Class decorator adding a template under ``name`` (and aliases) to ``CHAT_TEMPLATES``."""

    def wrap(cls: type[BaseChatTemplate]) -> type[BaseChatTemplate]:
        for key in (name, *aliases):
            if key in CHAT_TEMPLATES:
                raise ValueError(f"chat template {key!r} is already registered; pick another name")
            CHAT_TEMPLATES[key] = cls
        cls.name = name
        return cls

    return wrap


def list_chat_templates() -> list[str]:
    """Names of all registered chat templates, aliases included."""
    return list(CHAT_TEMPLATES)


@register_chat_template("base")
@dataclass
class Base(BaseChatTemplate):
    """No template: the prompt is the user's text as is (base, non-chat models)."""

    capability: Capability | None = "completion"


@register_chat_template("chatml")
@dataclass
class ChatML(BaseChatTemplate):
    """OpenAI ChatML: ``<|im_start|>role\\n...<|im_end|>``."""

    system: str = "<|im_start|>system\n"
    eosys: str = "<|im_end|>\n"
    user: str = "<|im_start|>user\n"
    eoh: str = "<|im_end|>\n"
    assistant: str = "<|im_start|>assistant\n"
    eoa: str = "<|im_end|>"
    separator: str = "\n"
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>"])


_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _hermes_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 default_system: str | None) -> list[dict[str, Any]]:
    """A chat with tools as Qwen2.5's and Qwen3's templates write it in ChatML: the tools in the
    system message, calls as ``<tool_call>`` blocks in the assistant's text, a run of tool
    results as one user turn of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    if tools:
        system = _text(messages[0].get("content") or "") if messages[0].get("role") == "system" else default_system
        block = _HERMES_TOOLS.format(tools="".join("\n" + _tojson(t) for t in tools))
        out.append({"role": "system", "content": f"{system}\n\n{block}" if system else block})
        if messages[0].get("role") == "system":
            messages = messages[1:]
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            content = _text(m.get("content") or "")
            calls = "\n".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, _tojson(args))
                              for name, args in map(_call_parts, m["tool_calls"]))
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"<tool_response>\n{_text(m.get('content') or '')}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        else:
            out.append(m)
    return out


@register_chat_template("qwen", "qwen2")
@dataclass
class Qwen(ChatML):
    """Qwen chat models: ChatML with Qwen's default system prompt."""

    meta_instruction: str | None = "You are a helpful assistant."
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("qwen",)
    exclude_patterns: ClassVar[tuple[str, ...]] = ("qwen3",)
    tool_format: ClassVar[str | None] = "hermes"

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        return _hermes_chat(messages, tools, self.meta_instruction if sequence_start else None)


@register_chat_template("internlm2", "internlm3")
@dataclass
class InternLM2(ChatML):
    """InternLM2 chat models: ChatML with InternLM's default system prompt."""

    meta_instruction: str | None = (
        "You are an AI assistant whose name is InternLM (书生·浦语).\n"
        "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI "
        "Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
        "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the "
        "user such as English and 中文."
    )
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>", "<|action_end|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("internlm2", "internlm3")
    tool_format: ClassVar[str | None] = "internlm"

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        # InternLM2's published chat format (InternLM's chat/chat_format.md), tools as LMDeploy
        # writes them: the functions' JSON in a system turn of its own, named <|plugin|>, after
        # the system prompt; a call follows the assistant's text as
        # <|action_start|><|plugin|>\n{"name", "parameters"}<|action_end|>; each result is an
        # environment turn named <|plugin|>.
        out: list[dict[str, Any]] = []
        if tools:
            listing = _tojson([t.get("function", t) for t in tools])
            at = 1 if messages and messages[0].get("role") == "system" else 0
            messages = [*messages[:at], {"role": _RAW_ROLE, "content": (
                f"<|im_start|>system name=<|plugin|>\n{listing}{self.eosys}")}, *messages[at:]]
        for m in messages:
            role = m.get("role")
            if role == "assistant" and m.get("tool_calls"):
                calls = "".join("<|action_start|><|plugin|>\n%s<|action_end|>"
                                % _tojson({"name": name, "parameters": args})
                                for name, args in map(_call_parts, m["tool_calls"]))
                out.append({"role": "assistant", "content": _text(m.get("content") or "") + calls})
            elif role == "tool":
                result = _text(m.get("content") or "")
                out.append({"role": _RAW_ROLE, "content": (
                    f"<|im_start|>environment name=<|plugin|>\n{result}{self.eoa}{self.separator}")})
            else:
                out.append(m)
        return out


@register_chat_template("llama3")
@dataclass
class Llama3(BaseChatTemplate):
    """Llama 3 / 3.x instruct; ``<|begin_of_text|>`` is left to the tokenizer."""

    system: str = "<|start_header_id|>system<|end_header_id|>\n\n"
    eosys: str = "<|eot_id|>"
    user: str = "<|start_header_id|>user<|end_header_id|>\n\n"
    eoh: str = "<|eot_id|>"
    assistant: str = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    eoa: str = "<|eot_id|>"
    stop_words: list[str] = field(default_factory=lambda: ["<|eot_id|>", "<|end_of_text|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("llama-3", "llama3", "llama_3")
    exclude_patterns: ClassVar[tuple[str, ...]] = ("llama-3.1-", "llama3.1-", "llama-3.2-", "llama3.2-")


@register_chat_template("llama2")
@dataclass
class Llama2(BaseChatTemplate):
    """Llama 2 chat: ``[INST] <<SYS>>...<</SYS>> ... [/INST]``; later turns start with ``<s>``."""

    system: str = "<<SYS>>\n"
    meta_instruction: str | None = (
        "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, "
        "while being safe. Your answers should not include any harmful, unethical, racist, sexist, "
        "toxic, dangerous, or illegal content. Please ensure that your responses are socially unbiased "
        "and positive in nature.\n\nIf a question does not make any sense, or is not factually "
        "coherent, explain why instead of answering something not correct. If you don't know the "
        "answer to a question, please don't share false information."
    )
    eosys: str = "\n<</SYS>>\n\n"
    user: str = "[INST] "
    eoh: str = " [/INST]"
    assistant: str = " "
    eoa: str = " </s>"
    # Each turn of Llama 2 is its own BOS...EOS sequence; the first BOS comes from the tokenizer.
    separator: str = "<s>"
    stop_words: list[str] = field(default_factory=lambda: ["</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("llama-2", "llama2", "llama_2")
    system_in_user: ClassVar[bool] = True


@register_chat_template("mistral", "mixtral")
@dataclass
class Mistral(BaseChatTemplate):
    """Mistral instruct: ``[INST] ... [/INST]answer</s>``; no system role, so it joins the first user turn."""

    eosys: str = "\n\n"
    user: str = "[INST] "
    eoh: str = " [/INST]"
    eoa: str = "</s>"
    stop_words: list[str] = field(default_factory=lambda: ["</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("mistral", "mixtral")
    system_in_user: ClassVar[bool] = True
    tool_format: ClassVar[str | None] = "mistral"

    def _tool_prompt(self, messages: list[dict[str, Any]], sequence_start: bool, add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any]) -> str:
        # Tools came with v0.3, whose layout differs from v0.1's (LMDeploy's, above): a chat with
        # tools renders whole in v0.3's.
        return BaseChatTemplate._tool_prompt(_MistralV3(), messages, sequence_start, add_generation_prompt,
                                             continue_final_message, tools, template_kwargs)


@dataclass
class _MistralV3(Mistral):
    """Mistral-7B-Instruct-v0.3's published template, which a chat with tools renders in:
    ``[INST] ...[/INST] answer</s>``, the tools in ``[AVAILABLE_TOOLS]`` before the last user
    turn, calls as ``[TOOL_CALLS] [{"name", "arguments", "id"}]</s>``, results as
    ``[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]``.

    Two choices where the Jinja text falls short: the system message joins the last user turn
    as mistral-common's tokenizer puts it (the Jinja drops it unless the chat ends on that turn,
    as it does while a tool loop runs), and a call id that is not 9 letters or digits (the
    Jinja raises) is mapped to one, its result's ``tool_call_id`` alike, so pairs stay pairs.
    Tool descriptions are JSON strings (the Jinja writes them unescaped, which breaks on a quote).
    """

    eoh: str = "[/INST]"
    assistant: str = " "
    generation_prompt: ClassVar[str | None] = ""
    system_in_user: ClassVar[bool] = False

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        system = None
        if messages and messages[0].get("role") == "system":
            system, messages = _text(messages[0].get("content") or ""), messages[1:]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        last_user = users[-1] if users else None
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role == "user" and i == last_user:
                if tools:
                    listing = _mistral_tools(tools)
                    out.append({"role": _RAW_ROLE, "content": f"[AVAILABLE_TOOLS] {listing}[/AVAILABLE_TOOLS]"})
                if system is not None:
                    m = {**m, "content": f"{system}\n\n{_text(m.get('content') or '')}"}
                out.append(m)
            elif role == "assistant" and m.get("tool_calls"):
                calls = ", ".join(_tojson({"name": name, "arguments": args})[:-1] + ', "id": "%s"}' % _mistral_id(call)
                                  for call, (name, args) in zip(m["tool_calls"], map(_call_parts, m["tool_calls"])))
                out.append({"role": _RAW_ROLE, "content": f"[TOOL_CALLS] [{calls}]{self.eoa}"})
            elif role == "assistant":
                out.append({**m, "content": _text(m.get("content") or "").strip()})
            elif role == "tool":
                result, call_id = _text(m.get("content") or ""), _mistral_id(m.get("tool_call_id"))
                turn = f'[TOOL_RESULTS] {{"content": {result}, "call_id": "{call_id}"}}[/TOOL_RESULTS]'
                out.append({"role": _RAW_ROLE, "content": turn})
            else:
                out.append(m)
        return out


def _mistral_tools(tools: list[dict[str, Any]]) -> str:
    """The tool listing of Mistral v0.3: each function's fields but ``return``, in order."""
    listed = [{"type": "function", "function": {k: v for k, v in t.get("function", t).items() if k != "return"}}
              for t in tools]
    return _tojson(listed)


def _mistral_id(call_or_id: Any) -> str:
    """A tool call's id as Mistral's templates take it, 9 letters or digits: such an id is kept;
    any other is mapped to its last 9 letters and digits (vLLM keeps the last 9 characters), or
    to a digest when it has fewer."""
    raw = call_or_id.get("id") if isinstance(call_or_id, dict) else call_or_id
    raw = "" if raw is None else str(raw)
    alnum = "".join(ch for ch in raw if ch.isascii() and ch.isalnum())
    if len(alnum) >= 9:
        return alnum[-9:]
    return hashlib.sha1(raw.encode()).hexdigest()[:9]


@register_chat_template("vicuna")
@dataclass
class Vicuna(BaseChatTemplate):
    """Vicuna v1.1+: ``SYSTEM USER: ... ASSISTANT: ...</s>``."""

    meta_instruction: str | None = (
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions."
    )
    eosys: str = " "
    user: str = "USER: "
    eoh: str = " "
    assistant: str = "ASSISTANT: "
    eoa: str = "</s>"
    stop_words: list[str] = field(default_factory=lambda: ["</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("vicuna",)
    exclude_patterns: ClassVar[tuple[str, ...]] = ("llava",)  # llava-v1.6-vicuna: llava-v1 below


@register_chat_template("llava-v1")
@dataclass
class LlavaV1(Vicuna):
    """LLaVA 1.5 / 1.6-vicuna (the original repository's ``conv_vicuna_v1``, LMDeploy's
    ``llava-v1``): Vicuna's format with "human" in the system prompt."""

    meta_instruction: str | None = (
        "A chat between a curious human and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the human's questions.")
    match_patterns: ClassVar[tuple[str, ...]] = ("llava-v1", "llava-1.5")
    exclude_patterns: ClassVar[tuple[str, ...]] = ("v1.6-34b", "mistral", "-hf")


@register_chat_template("llava-chatml")
@dataclass
class LlavaChatml(BaseChatTemplate):
    """liuhaotian/llava-v1.6-34b (the original repository's ``conv_chatml_direct``)."""

    system: str = "<|im_start|>system\n"
    meta_instruction: str | None = "Answer the questions."
    eosys: str = "<|im_end|>"
    user: str = "<|im_start|>user\n"
    eoh: str = "<|im_end|>"
    assistant: str = "<|im_start|>assistant\n"
    eoa: str = "<|im_end|>"
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("llava-v1.6-34b",)


@register_chat_template("yi-vl")
@dataclass
class YiVL(BaseChatTemplate):
    """Yi-VL (01-ai/Yi-VL-6B / 34B): its repository's ``mm_default`` conversation, as LMDeploy's
    ``yi-vl``."""

    meta_instruction: str | None = (
        "This is a chat between an inquisitive human and an AI assistant. Assume the role of the AI assistant. "
        "Read all the images carefully, and respond to the human's questions with informative, helpful, detailed "
        "and polite answers. 这是一个好奇的人类和一个人工智能助手之间的对话。假设你扮演这个AI助手的角色。"
        "仔细阅读所有的图像，并对人类的问题做出信息丰富、有帮助、详细的和礼貌的回答。\n\n")
    user: str = "### Human: "
    eoh: str = "\n"
    assistant: str = "### Assistant:"
    eoa: str = "\n"
    stop_words: list[str] = field(default_factory=lambda: ["###"])
    match_patterns: ClassVar[tuple[str, ...]] = ("yi-vl",)


@register_chat_template("internlm")
@dataclass
class InternLM(BaseChatTemplate):
    """InternLM (v1) chat, internlm-chat-7b/20b: ``<|System|>:...\\n<|User|>:...\\n<|Bot|>:...<eoa>\\n``.

    No Jinja template was published for it; the strings are the format of its ``build_inputs``
    (modeling_internlm.py of internlm-chat-7b v1.1 and internlm-chat-20b), as LMDeploy's ``internlm``.
    """

    system: str = "<|System|>:"
    meta_instruction: str | None = (
        "You are an AI assistant whose name is InternLM (书生·浦语).\n"
        "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI "
        "Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
        "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the "
        "user such as English and 中文.\n"
    )
    eosys: str = "\n"
    user: str = "<|User|>:"
    eoh: str = "\n"
    assistant: str = "<|Bot|>:"
    eoa: str = "<eoa>"
    separator: str = "\n"
    stop_words: list[str] = field(default_factory=lambda: ["<eoa>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("internlm",)
    exclude_patterns: ClassVar[tuple[str, ...]] = ("internlm2", "internlm3", "8k")

    @classmethod
    def match(cls, model_path: str) -> bool:
        """LMDeploy's rule: an ``internlm`` *chat* model that is not InternLM2/3 (nor the 8k one)."""
        return super().match(model_path) and "chat" in model_path.lower()


@register_chat_template("baichuan2")
@dataclass
class Baichuan2(BaseChatTemplate):
    """Baichuan2 chat: ``<reserved_106>`` before each user turn, ``<reserved_107>`` before each answer.

    As Baichuan2's ``generation_utils.build_chat_input``: the system text first, bare, and no token
    between an answer and the next user turn (the model ends its answer with ``</s>``).
    """

    user: str = "<reserved_106>"
    assistant: str = "<reserved_107>"
    stop_words: list[str] = field(default_factory=lambda: ["</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("baichuan2",)

    @classmethod
    def match(cls, model_path: str) -> bool:
        """LMDeploy's rule: a Baichuan2 *chat* model (the base models take plain text)."""
        return super().match(model_path) and "chat" in model_path.lower()


@register_chat_template("chatglm2", "chatglm")
@dataclass
class ChatGLM2(BaseChatTemplate):
    """ChatGLM2-6B: ``[Round n]\\n\\n问：...\\n\\n答：...\\n\\n`` with rounds counted from 1.

    The format of ChatGLM2's ``build_prompt`` (modeling_chatglm.py); it has no Jinja template and no
    system role, so a system message goes in front of the first round, followed by a blank line.
    The ``[gMASK]sop`` prefix is added by its tokenizer. LMDeploy names this template ``chatglm``.
    """

    eosys: str = "\n\n"
    user: str = "问："
    eoh: str = "\n\n"
    assistant: str = "答："
    eoa: str = "\n\n"
    stop_words: list[str] = field(default_factory=lambda: ["</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("chatglm2",)

    def get_prompt(self, prompt: str, sequence_start: bool = True) -> str:
        """One round. A later turn of a session (sequence_start=False) does not know its round number
        and goes without the ``[Round n]`` line; send the whole chat (messages2prompt) to have it."""
        if sequence_start:
            return self._render([{"role": "user", "content": prompt}])
        return f"{self.eoa}{self.user}{prompt}{self.eoh}{self.assistant}"

    def _render(self, messages: list[dict[str, Any]], sequence_start: bool = True,
                generation_prompt: bool = True) -> str:
        ret, rounds = "", 0
        for msg in messages:
            role, content = msg.get("role"), _text(msg.get("content", ""))
            if role == "system":
                ret += f"{content}{self.eosys}"
            elif role == "user":
                rounds += 1
                ret += f"[Round {rounds}]\n\n{self.user}{content}{self.eoh}{self.assistant}"
            elif role == "assistant":
                ret += f"{content}{self.eoa}"
            else:
                raise ValueError(f"unsupported message role {role!r}: use 'system', 'user' or 'assistant'")
        if not generation_prompt and messages and messages[-1].get("role") == "user":
            ret = ret[:-len(self.assistant)]  # each round opens the answer; without a generation prompt, not
        return ret  # ends at 答： after a user turn; after an answer, where the next round starts


@register_chat_template("chatglm3")
@dataclass
class ChatGLM3(BaseChatTemplate):
    """ChatGLM3-6B: ``<|role|>\\n content`` per message, the prompt ends with a bare ``<|assistant|>``.

    As THUDM/chatglm3-6b's tokenizer_config.json chat_template, without its leading ``[gMASK]sop``:
    the ChatGLM3 tokenizer adds those prefix tokens when it encodes, as others add BOS.
    """

    system: str = "<|system|>\n "
    user: str = "<|user|>\n "
    assistant: str = "<|assistant|>\n "
    stop_words: list[str] = field(default_factory=lambda: ["<|user|>", "<|observation|>", "</s>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("chatglm3",)
    generation_prompt: ClassVar[str | None] = "<|assistant|>"


@register_chat_template("glm4")
@dataclass
class GLM4(ChatGLM3):
    """GLM-4 chat (glm-4-9b-chat): ChatGLM3's layout without the space after each role's newline.

    As THUDM/glm-4-9b-chat's tokenizer_config.json chat_template (tools aside), without its leading
    ``[gMASK]<sop>``, which the GLM-4 tokenizer adds when it encodes.
    """

    system: str = "<|system|>\n"
    user: str = "<|user|>\n"
    assistant: str = "<|assistant|>\n"
    stop_words: list[str] = field(default_factory=lambda: ["<|user|>", "<|endoftext|>", "<|observation|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("glm-4", "glm4")
    exclude_patterns: ClassVar[tuple[str, ...]] = ("chatglm",)


@register_chat_template("gemma")
@dataclass
class Gemma(BaseChatTemplate):
    """Gemma instruct: ``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``.

    Gemma has no system role: as Gemma 3's template does, a system message opens the first user
    turn followed by a blank line (Gemma 1/2's templates refuse a system message instead).
    """

    eosys: str = "\n\n"
    user: str = "<start_of_turn>user\n"
    eoh: str = "<end_of_turn>\n"
    assistant: str = "<start_of_turn>model\n"
    # The model stops at <end_of_turn>; the newline after it belongs before the next turn.
    eoa: str = "<end_of_turn>"
    separator: str = "\n"
    stop_words: list[str] = field(default_factory=lambda: ["<end_of_turn>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("gemma",)
    system_in_user: ClassVar[bool] = True


@register_chat_template("phi-3")
@dataclass
class Phi3(BaseChatTemplate):
    """Phi-3 / Phi-3.5 instruct: ``<|role|>\\n...<|end|>\\n`` per message."""

    system: str = "<|system|>\n"
    eosys: str = "<|end|>\n"
    user: str = "<|user|>\n"
    eoh: str = "<|end|>\n"
    assistant: str = "<|assistant|>\n"
    eoa: str = "<|end|>"
    separator: str = "\n"
    stop_words: list[str] = field(default_factory=lambda: ["<|end|>", "<|endoftext|>", "<|assistant|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("phi-3",)

    @classmethod
    def match(cls, model_path: str) -> bool:
        """LMDeploy's rule: a Phi-3 *instruct* model."""
        return super().match(model_path) and "instruct" in model_path.lower()


@register_chat_template("falcon")
@dataclass
class Falcon(Base):
    """Falcon (LMDeploy's ``falcon``): no chat format, the text as is; Falcon 3's tokenizers ship a
    Jinja template, which is used instead when present."""

    match_patterns: ClassVar[tuple[str, ...]] = ("falcon",)


@register_chat_template("llama3_1", "llama3_2")
@dataclass
class Llama3_1(Llama3):
    """Llama 3.1 / 3.2 instruct: Llama 3 with the knowledge-date header that opens every system block.

    As Meta's published template (tools aside): the system block is always there, empty when the
    chat has no system message, and starts with ``Cutting Knowledge Date: December 2023`` and
    ``Today Date: 26 Jul 2024`` (the template's default date_string).
    """

    system: str = ("<|start_header_id|>system<|end_header_id|>\n\n"
                   "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")
    meta_instruction: str | None = ""
    stop_words: list[str] = field(default_factory=lambda: ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("llama-3.1-", "llama3.1-", "llama-3.2-", "llama3.2-")
    exclude_patterns: ClassVar[tuple[str, ...]] = ()
    tool_format: ClassVar[str | None] = "llama3_json"

    def _render(self, messages: list[dict[str, Any]], sequence_start: bool = True,
                generation_prompt: bool = True) -> str:
        if messages and messages[0].get("_tools"):  # Meta's template says so in the system block
            head = "<|start_header_id|>system<|end_header_id|>\n\n"
            tooled = replace(self, system=self.system.replace(head, head + "Environment: ipython\n", 1))
            return BaseChatTemplate._render(tooled, messages, sequence_start, generation_prompt)
        return super()._render(messages, sequence_start, generation_prompt)

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        # As Meta's template with its default tools_in_user_message: the tools open the first
        # user message; a call is the assistant's whole text; a result is an ipython turn.
        out: list[dict[str, Any]] = []
        if tools:
            system = messages[0] if messages[0].get("role") == "system" else {"role": "system", "content": ""}
            out.append({**system, "_tools": True})
            rest = messages[1:] if messages[0].get("role") == "system" else messages
            users = [i for i, m in enumerate(rest) if m.get("role") == "user"]
            if not users:
                raise ValueError("Llama 3.1's tool format puts the tools in the first user message: the chat has "
                                 "no user message")
            listing = "".join(_tojson(t, indent=4) + "\n\n" for t in tools)
            first = rest[users[0]]
            rest = [*rest[:users[0]], {**first, "content": _LLAMA_TOOLS + listing + _text(first.get("content") or "")},
                    *rest[users[0] + 1:]]
            messages = rest
        for m in messages:
            role = m.get("role")
            if role == "assistant" and m.get("tool_calls"):
                if len(m["tool_calls"]) != 1:
                    raise ValueError("Llama 3.1's tool format takes one tool call per assistant message")
                name, args = _call_parts(m["tool_calls"][0])
                out.append({"role": "assistant", "content": '{"name": "%s", "parameters": %s}' % (name, _tojson(args))})
            elif role == "tool":
                content = m.get("content")
                result = _tojson(content if content is not None else "")
                out.append({"role": _RAW_ROLE,
                            "content": f"<|start_header_id|>ipython<|end_header_id|>\n\n{result}{self.eoa}"})
            else:
                out.append(m)
        return out


_LLAMA_TOOLS = ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n")


@register_chat_template("qwen3")
@dataclass
class Qwen3(ChatML):
    """Qwen3: ChatML with no default system prompt (the model thinks first unless told not to:
    ``chat_template_kwargs`` ``enable_thinking: false`` closes an empty think block after the
    generation prompt, as Qwen3's own template does)."""

    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("qwen3",)
    tool_format: ClassVar[str | None] = "hermes"

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    sequence_start: bool) -> list[dict[str, Any]]:
        return _hermes_chat(messages, tools, None)

    def _after_generation_prompt(self, template_kwargs: dict[str, Any]) -> str:
        return "<think>\n\n</think>\n\n" if template_kwargs.get("enable_thinking", True) is False else ""


@register_chat_template("dbrx")
@dataclass
class Dbrx(ChatML):
    """DBRX Instruct: ChatML with Databricks' default system prompt, as the chat_template of
    databricks/dbrx-instruct's tokenizer_config.json renders it: the default stands in when the
    chat opens with no system message, and a first system message is trimmed of outer whitespace."""

    meta_instruction: str | None = (
        "You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions "
        "based on information available up to that point.\n"
        "YOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR STATEMENTS, but provide thorough responses to more "
        "complex and open-ended questions.\n"
        "You assist with various tasks, from writing to coding (using markdown for code blocks \u2014 remember to "
        "use ``` with code, JSON, and tables).\n"
        "(You do not have real-time data access or code execution capabilities. You avoid stereotyping and "
        "provide balanced perspectives on controversial topics. You do not provide song lyrics, poems, or news "
        "articles and do not divulge details of your training data.)\n"
        "This is your system prompt, guiding your responses. Do not reference it, just respond to the user. If "
        "you find yourself talking about this message, stop. You should be responding appropriately and usually "
        "that means not mentioning this.\n"
        "YOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS THE INFORMATION IS DIRECTLY PERTINENT "
        "TO THE USER'S QUERY."
    )
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("dbrx",)

    def _render(self, messages: list[dict[str, Any]], sequence_start: bool = True,
                generation_prompt: bool = True) -> str:
        if messages and messages[0].get("role") == "system":  # the published template's ``| trim``
            messages = [{**messages[0], "content": _text(messages[0].get("content", "")).strip()}, *messages[1:]]
        return super()._render(messages, sequence_start, generation_prompt)


@register_chat_template("deepseek")
@dataclass
class Deepseek(BaseChatTemplate):
    """DeepSeek LLM / DeepSeek-MoE / DeepSeek-V2 chat: ``User: ...\n\nAssistant: ...<｜end▁of▁sentence｜>``,
    a system message's text first followed by a blank line.

    As the chat_template of deepseek-llm-7b-chat's and deepseek-moe-16b-chat's tokenizer_config.json
    (bos_token left to the tokenizer): the prompt ends at ``Assistant:`` with no space, which the
    model writes itself (LMDeploy's ``deepseek`` prompts with ``Assistant: ``). Matched as
    LMDeploy matches it: a DeepSeek *chat* model that is not a VL one.
    """

    eosys: str = "\n\n"
    user: str = "User: "
    eoh: str = "\n\n"
    assistant: str = "Assistant: "
    eoa: str = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    stop_words: list[str] = field(default_factory=lambda: ["<\uff5cend\u2581of\u2581sentence\uff5c>"])
    match_patterns: ClassVar[tuple[str, ...]] = ("deepseek",)
    exclude_patterns: ClassVar[tuple[str, ...]] = ("-vl",)
    generation_prompt: ClassVar[str | None] = "Assistant:"

    @classmethod
    def match(cls, model_path: str) -> bool:
        """LMDeploy's rule: a DeepSeek *chat* model (the base models take plain text)."""
        return super().match(model_path) and "chat" in model_path.lower()


@register_chat_template("deepseek-vl")
@dataclass
class DeepseekVL(Deepseek):
    """DeepSeek-VL chat (deepseek-vl-7b-chat, -1.3b-chat): DeepSeek's format with the system prompt
    its VLChatProcessor writes (sft_format "deepseek"), as LMDeploy's ``deepseek-vl``."""

    meta_instruction: str | None = (
        "You are a helpful language and vision assistant. You are able to understand the visual content "
        "that the user provides, and assist the user with a variety of tasks using natural language.")
    match_patterns: ClassVar[tuple[str, ...]] = ("deepseek-vl",)
    exclude_patterns: ClassVar[tuple[str, ...]] = ("deepseek-vl2",)


# The built-in templates that render tools (the names to suggest when one cannot).
TOOL_TEMPLATES = tuple(name for name, cls in CHAT_TEMPLATES.items() if cls.tool_format)


def _decoded_call(call: Any) -> Any:
    """An OpenAI tool call with its ``function.arguments`` JSON text decoded into an object."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            return call
        if isinstance(decoded, dict):
            return {**call, "function": {**call["function"], "arguments": decoded}}
    return call


def _reads_content_parts(source: Any) -> bool:
    """Whether a Jinja chat template loops over a message's content (OpenAI's list of parts, as
    multimodal templates do) rather than using it as a string.

    A template of the second kind fed a list of parts fails (``'...' + message['content']``
    raises TypeError) or prints the list; so the parts are joined for it, and kept for the first.
    Read from the template's syntax tree: a ``for`` whose iterable reads ``content``, directly or
    through a variable set from it."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(source, str):
        return False
    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except TemplateSyntaxError:  # a tag only transformers knows ({% generation %}): strings, the common case
        return False

    def reads_content(node: nodes.Node) -> bool:
        for n in (node, *node.find_all((nodes.Getattr, nodes.Getitem, nodes.Name))):
            if isinstance(n, nodes.Getattr) and n.attr == "content":
                return True
            if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content":
                return True
            if isinstance(n, nodes.Name) and n.name in content_names:
                return True
        return False

    content_names: set[str] = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and reads_content(assign.node):
            content_names.add(assign.target.name)
    return any(reads_content(loop.iter) for loop in tree.find_all(nodes.For))


class HFChatTemplate:
    """The Jinja ``chat_template`` a transformers tokenizer ships with."""

    name: ClassVar[str] = "hf"
    capability: Capability | None = "chat"

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template; use a built-in template (conveyor list)")
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token", None)
        self.stop_words: list[str] = [eos] if eos else []
        # A content list of text parts goes to the template as parts only if it loops over them.
        self.reads_parts = _reads_content_parts(tokenizer.chat_template)
        # Templates such as Llama 3's render the BOS that the tokenizer also adds on encode: then the
        # caller must encode with add_special_tokens=False, or the model sees two BOS tokens.
        bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
        adds_bos = bos_id is not None and tokenizer("x")["input_ids"][:1] == [bos_id]
        probe = self._apply([{"role": "user", "content": "x"}], True)
        self.includes_bos: bool = bool(adds_bos and bos and probe.startswith(bos))

    @classmethod
    def match(cls, model_path: str) -> bool:
        """Never selected by name: it is chosen when the tokenizer has a template."""
        return False

    def _apply(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **template_kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            self._content(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def _content(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose content the template can read: parts kept for a template that loops
        over them, else joined into one string (by newlines, as the server's ingress joins them);
        tool calls' arguments as objects (OpenAI sends JSON text; templates ``tojson`` them)."""
        if any(m.get("tool_calls") for m in messages):
            messages = [{**m, "tool_calls": [_decoded_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                        for m in messages]
        if self.reads_parts or all(isinstance(m.get("content"), str | None) for m in messages):
            return messages
        return [m if isinstance(m.get("content"), str | None) else
                {**m, "content": _text(m["content"])}
                for m in messages]

    def get_prompt(self, prompt: str, sequence_start: bool = True, **template_kwargs: Any) -> str:
        """Prompt for one user turn; with sequence_start=False only the new turn's text."""
        if sequence_start:
            return self._apply([{"role": "user", "content": prompt}], True, **template_kwargs)
        # Render a dummy history with and without the new turn and keep the difference, cut just
        # after the history's last eos, because the session's previous output ended there.
        history = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        head = self._apply(history, False, **template_kwargs)
        full = self._apply([*history, {"role": "user", "content": prompt}], True, **template_kwargs)
        cut = len(head)
        if self.stop_words and self.stop_words[0] in head:
            cut = head.rindex(self.stop_words[0]) + len(self.stop_words[0])
        if not full.startswith(head[:cut]):
            logger.warning("chat template re-renders history differently; sending the whole prompt")
            return full
        return full[cut:]

    def messages2prompt(self, messages: Messages, sequence_start: bool = True, *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """Prompt for a user string or an OpenAI-style message list, via ``apply_chat_template``;
        ``template_kwargs`` (the request's chat_template_kwargs) are the template's variables."""
        if isinstance(messages, str):
            return self.get_prompt(messages, sequence_start, **template_kwargs)
        if continue_final_message:
            final = _final_to_continue(messages)
            return _cut_at_mark(self._apply(_marked(messages), False, **template_kwargs), final)
        return self._apply(messages, add_generation_prompt, **template_kwargs)


ChatTemplate = BaseChatTemplate | HFChatTemplate


@dataclass
class ChatTemplateConfig:
    """Which chat template to use and which of its strings to override (LMDeploy-compatible).

    ``model_name`` is a built-in name (``conveyor list``) whose non-None fields here override the
    defaults, or a new name, in which case ``user`` and ``assistant`` at least must be given.
    """

    model_name: str
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    separator: str | None = None
    capability: Capability | None = None
    stop_words: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("ChatTemplateConfig.model_name must be a non-empty str, e.g. 'llama3'")
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"ChatTemplateConfig.{name} must be a str or None, got {value!r}")
        if self.capability is not None and self.capability not in CAPABILITIES:
            raise ValueError(f"ChatTemplateConfig.capability must be one of {CAPABILITIES} or None, "
                             f"got {self.capability!r}")
        if self.stop_words is not None:
            if isinstance(self.stop_words, str) or not all(isinstance(w, str) for w in self.stop_words):
                raise ValueError("ChatTemplateConfig.stop_words must be a list of str, e.g. ['<|im_end|>']")
            self.stop_words = list(self.stop_words)

    def _overrides(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in TEMPLATE_FIELDS if getattr(self, k) is not None}

    def to_template(self) -> BaseChatTemplate:
        """The built-in template for ``model_name`` with this config's non-None fields applied."""
        overrides = self._overrides()
        cls = CHAT_TEMPLATES.get(self.model_name)
        if cls is not None:
            return cls(**overrides)
        if self.user is None or self.assistant is None:
            raise UnknownChatTemplateError(
                f"unknown chat template {self.model_name!r}; available: {', '.join(list_chat_templates())}. "
                "Run `conveyor list` to see them, or pass a ChatTemplateConfig with explicit fields "
                "(at least user and assistant) to define a new one.")
        template = BaseChatTemplate(**overrides)
        template.name = self.model_name  # a custom template reports the name it was given
        logger.info("using custom chat template %r", self.model_name)
        return template

    @property
    def chat_template(self) -> BaseChatTemplate:
        """Same as ``to_template()`` (LMDeploy's spelling)."""
        return self.to_template()

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text of this config; also written to ``path`` when given."""
        text = json.dumps(asdict(self), ensure_ascii=False, indent=4)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, file_or_string: str | Path) -> ChatTemplateConfig:
        """Config from a JSON file path or a JSON string."""
        text = str(file_or_string)
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ValueError(f"{text!r} is neither a JSON file nor a JSON object string")
            text = path.read_text(encoding="utf-8")
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ChatTemplateConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)


def template_config(spec: str | None) -> ChatTemplateConfig | None:
    """``--chat-template``'s value: a built-in name (``conveyor list``) or a JSON file of
    ChatTemplateConfig fields (LMDeploy's ``--chat-template path.json``); None for none. A bad
    value raises ``UnknownChatTemplateError`` naming what would do."""
    if not spec:
        return None
    if spec.endswith(".json") or Path(spec).is_file():
        try:
            config = ChatTemplateConfig.from_json(spec)
        except (ValueError, OSError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise UnknownChatTemplateError(f"chat template file {spec!r}: {exc}") from exc
    else:
        try:
            config = ChatTemplateConfig(model_name=spec)
        except ValueError as exc:
            raise UnknownChatTemplateError(str(exc)) from exc
    config.to_template()  # an unknown name or missing fields fail here, before any stage starts
    return config


def template_for_model_name(name: str) -> ChatTemplateConfig | None:
    """The built-in template a model name asks for (LMDeploy's ``pipeline(path, 'internlm2-chat-7b')``):
    the template of that name, else the one whose family the name matches; None when neither."""
    if name in CHAT_TEMPLATES:
        return ChatTemplateConfig(model_name=name)
    for registered, cls in CHAT_TEMPLATES.items():
        if cls is not Base and cls.match(name):
            return ChatTemplateConfig(model_name=registered)
    return None


def get_chat_template(model_path: str, chat_template_config: ChatTemplateConfig | None = None,
                      tokenizer: Any = None) -> ChatTemplate:
    """Pick the template: the config's, else the tokenizer's own Jinja one, else by model path, else base."""
    if chat_template_config is not None:
        template: ChatTemplate = chat_template_config.to_template()
    elif tokenizer is not None and getattr(tokenizer, "chat_template", None):
        template = HFChatTemplate(tokenizer)
    else:
        template = _match_builtin(model_path)
    logger.info("chat template for %s: %s", model_path, template.name)
    return template


def _match_builtin(model_path: str) -> BaseChatTemplate:
    # The last path component is tried first so that parent folders (e.g. "/models/qwen/...") do
    # not decide; the full path is the fallback for snapshot folders named by a hash.
    tail = str(model_path).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    for candidate in (tail, str(model_path)):
        for cls in dict.fromkeys(CHAT_TEMPLATES.values()):  # aliases map to the same class: try once
            if cls.match(candidate):
                return cls()
    return Base()

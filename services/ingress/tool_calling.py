"""Tool calling and reasoning on the chat route: which parsers read a choice's output, and what
``tool_choice`` asks of the engine.

The server's settings (``ChatParsing``): the tool-call parser (``--tool-call-parser``, else the
format the chat template renders tools in) and the reasoning parser (``--reasoning-parser``).
A request's ``tools`` and ``tool_choice`` make a ``ToolPlan``:

- ``auto`` (the default with tools): the template renders the tools, nothing constrains the
  output, and the parser reads whatever calls the model printed.
- ``none``: the tools are still rendered (as vLLM does: the model sees the same prompt) but the
  output is not parsed for calls: it is all content.
- ``required`` and a named function are enforced with a grammar (``Guide("grammar", ebnf)``):
  the output can only be one call (or, with ``parallel_tool_calls``, several) of the allowed
  functions whose arguments match each function's ``parameters`` schema. For ``hermes`` the
  grammar writes the format the model was taught (``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>``); the other formats' markers are special tokens a grammar cannot emit
  (or, for ``llama3_json``, there are none), so there the output is the bare JSON call
  ``{"name": ..., "parameters": ...}`` (several separated by ``; ``), read by the
  ``llama3_json`` parser. That needs no known format at all, so these two choices work on a
  server without a tool-call parser too (``auto`` there is a 400 naming ``--tool-call-parser``).

Each choice's text then goes through a ``ChoiceParser``: the reasoning parser first (its
reasoning is ``reasoning_content``), then the tool-call parser on the rest (its calls are
``tool_calls``, the rest ``content``), streamed or whole, with the same result for both.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from ...protocol.errors import InvalidRequestError
from ...protocol.guided import Guide
from .reasoning_parsers import check_reasoning_parser, make_reasoning_parser
from .tool_parsers import (CallDelta, ContentDelta, ToolCall, check_tool_parser, default_tool_parser, make_tool_parser,
                           tool_parser_for_template_text, TOOL_PARSERS)

# The parser that reads a grammar-enforced call of a format whose markers a grammar cannot write.
_BARE_JSON = "llama3_json"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers of chat output: ``tool_parser`` None means requests with tools are
    refused (no format known), ``reasoning_parser`` None means no reasoning split."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    tool_parser_origin: str = ""  # where tool_parser came from, for messages
    # The generation prompt the chat template ends a turn with (its default options): a template
    # that opens <think> there (QwQ, Qwen3-*-Thinking-2507) starts every output inside the reasoning.
    generation_prompt: str | None = None

    @property
    def parses_output(self) -> bool:
        """Whether some request may need its output parsed."""
        return self.tool_parser is not None or self.reasoning_parser is not None


def chat_parsing(tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 template: Any = None) -> ChatParsing:
    """The server's parsers: the flags' (checked, LMDeploy's aliases accepted), else the tool
    format ``template`` (the chat template the tokenizer stage renders with) implies."""
    prompt = None
    if reasoning_parser:
        check_reasoning_parser(reasoning_parser)
        prompt = _generation_prompt(template)
    if tool_call_parser:
        return ChatParsing(check_tool_parser(tool_call_parser), reasoning_parser or None, "--tool-call-parser", prompt)
    name, origin = None, ""
    if template is not None:
        source = getattr(getattr(template, "tokenizer", None), "chat_template", None)
        if isinstance(source, str):  # the model's own Jinja template: the markers it renders
            name, origin = tool_parser_for_template_text(source), "the model's chat template"
        else:
            name = getattr(template, "tool_format", None) or default_tool_parser(getattr(template, "name", None))
            origin = f"the chat template {getattr(template, 'name', '')!r}"
    return ChatParsing(name, reasoning_parser or None, origin if name else "", prompt)


def _generation_prompt(template: Any) -> str | None:
    """The end of a one-message chat as ``template`` renders it, or None (no template, or it fails)."""
    if template is None:
        return None
    try:
        return template.messages2prompt([{"role": "user", "content": "x"}])[-64:]
    except Exception:  # noqa: BLE001 - only a hint for the reasoning parser; the tokenizer stage reports errors
        return None


# ---- the request side ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of it."""

    tools: list[dict[str, Any]] | None = None  # for the chat template
    parser: str | None = None  # the tool-call parser of each choice; None: no call parsing
    guide: Guide | None = None  # required / named: the calls the output must be
    single_call: bool = False  # parallel_tool_calls false: at most one call is returned
    keep_special_tokens: bool = False  # the parser's markers are special tokens: the detokenizer keeps them


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, parsing: ChatParsing) -> ToolPlan:
    """The plan of a request's ``tools`` (OpenAI's, already shaped) and ``tool_choice``."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not tools:
        if choice not in ("none", "auto"):
            raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools: send the functions in tools",
                                      param="tool_choice")
        return ToolPlan()
    names = [t["function"]["name"] for t in tools]
    if named is not None and named not in names:
        raise InvalidRequestError(f"tool_choice names {named!r}, which is not in tools (there: {', '.join(names)})",
                                  param="tool_choice")
    for tool in tools:
        check_parameters(tool["function"])
    if choice == "none":
        return ToolPlan(tools=tools)
    single = parallel_tool_calls is False
    if choice == "auto":
        parser = parsing.tool_parser
        if parser is None:
            raise InvalidRequestError(
                "tools: this server does not know the model's tool-call format (its chat template renders none "
                f"conveyor reads), so calls the model writes cannot be read: start it with --tool-call-parser NAME "
                f"({', '.join(sorted(TOOL_PARSERS))}), or send tool_choice \"required\" or a named function "
                "(a grammar writes those calls)", param="tools")
        return ToolPlan(tools, parser, None, single, TOOL_PARSERS[parser].needs_special_tokens)
    allowed = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    hermes = parsing.tool_parser == "hermes"
    ebnf = calls_grammar(tuple(json.dumps(f.get("parameters") or _EMPTY_PARAMETERS, sort_keys=True) for f in allowed),
                         tuple(f["name"] for f in allowed), hermes, single)
    return ToolPlan(tools, "hermes" if hermes else _BARE_JSON, Guide("grammar", ebnf), single)


def check_parameters(function: dict[str, Any]) -> None:
    """400 unless a function's ``parameters`` is a JSON Schema of an object that xgrammar reads."""
    params = function.get("parameters")
    if params is None:
        return
    if params.get("type", "object") != "object":
        raise InvalidRequestError(f"tools: {function['name']}.parameters must be a JSON Schema of an object "
                                  f"(type \"object\"), got type {params.get('type')!r}", param="tools")
    error = _schema_error(json.dumps(params, sort_keys=True))
    if error:
        raise InvalidRequestError(f"tools: {function['name']}.parameters is not a JSON Schema conveyor can "
                                  f"read: {error}", param="tools")


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> str | None:
    import xgrammar as xgr  # imported on first use: most requests carry no tools

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        return str(exc).rsplit(": ", 1)[-1][:300]
    return None


# An EBNF token: a quoted string, a character class, a name, or any other character.
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_.-]*|.', re.S)


def _renamed_root(ebnf: str, name: str) -> str:
    """``ebnf`` with its rules ``root`` and ``root_*`` renamed ``name`` / ``name_*`` (names only:
    a string or a character class that holds ``root`` is left alone)."""
    def rename(token: re.Match[str]) -> str:
        text = token.group()
        if text == "root" or text.startswith("root_"):
            return name + text[4:]
        return text
    return _EBNF_TOKEN.sub(rename, ebnf)


@functools.lru_cache(maxsize=256)
def calls_grammar(parameters: tuple[str, ...], names: tuple[str, ...], hermes: bool, single: bool) -> str:
    """EBNF text of an output made of calls to the functions ``names`` (``parameters``: each
    one's schema as JSON text): Hermes ``<tool_call>`` blocks, or bare JSON calls."""
    import xgrammar as xgr

    key = "arguments" if hermes else "parameters"
    variants = [{"type": "object", "properties": {"name": {"const": n}, key: json.loads(p)},
                 "required": ["name", key], "additionalProperties": False} for n, p in zip(names, parameters)]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    call = _renamed_root(str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)), "tool_call")
    if hermes:
        one, more = r'"<tool_call>\n" tool_call "\n</tool_call>"', r'"\n<tool_call>\n" tool_call "\n</tool_call>"'
    else:
        one, more = "tool_call", '"; " tool_call'
    return f"root ::= {one}" + ("" if single else f" ({more})*") + "\n" + call


# ---- the response side --------------------------------------------------------------------------

@dataclass
class Parsed:
    """What one piece of a choice's output turned out to be."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] | None = None


class ChoiceParser:
    """One choice's output split into reasoning, content and tool calls, streamed or whole."""

    def __init__(self, reasoning_parser: str | None, tool_parser: str | None, single_call: bool = False,
                 prompt: str | None = None):
        self._reasoner = make_reasoning_parser(reasoning_parser, prompt) if reasoning_parser else None
        self._tools = make_tool_parser(tool_parser) if tool_parser else None
        self._single = single_call
        self.reasoning = reasoning_parser is not None
        self.tool_calling = tool_parser is not None

    @property
    def has_calls(self) -> bool:
        """Whether the output called a tool (its finish_reason is then ``tool_calls``)."""
        return self._tools is not None and self._tools.has_calls

    def feed(self, text: str, final: bool = False) -> Parsed:
        """The parts one more piece of output decides (``final``: the output ended with it)."""
        reasoning, content = "", text
        if self._reasoner is not None:
            r1, c1 = self._reasoner.feed(text)
            r2, c2 = self._reasoner.finish() if final else ("", "")
            reasoning, content = r1 + r2, c1 + c2
        if self._tools is None:
            return Parsed(reasoning, content)
        deltas = self._tools.feed(content) + (self._tools.finish() if final else [])
        calls = [d for d in deltas if isinstance(d, CallDelta) and not (self._single and d.index > 0)]
        return Parsed(reasoning, "".join(d.text for d in deltas if isinstance(d, ContentDelta)), calls)

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole output; an empty part is None."""
        reasoning, content = None, text
        if self._reasoner is not None:
            reasoning, content = self._reasoner.split(text)
        if self._tools is None:
            return reasoning, content or None, []
        content, calls = self._tools.parse(content or "")
        return reasoning, content, calls[:1] if self._single else calls

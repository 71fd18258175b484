"""Tool-call parsers: find the function calls a model printed in its text, whole or streamed.

``--tool-call-parser`` picks one by vLLM's name; ``default_tool_parser`` names the one a model
family's chat template teaches. Formats (as the models print them):

- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole output is a call, ``{"name": "f",
  "parameters": {...}}`` (``"arguments"`` also accepted), optionally after ``<|python_tag|>``;
  several calls are separated by ``;`` (or whitespace). An output that does not open with a call
  is all content; text after the last call is content.
- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n
  </tool_call>``, several in a row; the text around them is content.
- ``internlm`` (InternLM2 / 2.5 / 3): ``<|action_start|><|plugin|>\\n{"name": "f", "parameters":
  {...}}<|action_end|>``; the text around it is content (``<|interpreter|>`` actions stay text).
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v0.3 tokenizers), and
  ``[TOOL_CALLS]f[ARGS]{...}`` (v11+; ``[CALL_ID]id`` before ``[ARGS]`` is read, and the form with
  ``[ARGS]`` dropped, ``[TOOL_CALLS]f{...}``, is accepted); the text before is content.

A call is kept only when its JSON parses into an object with a string ``name`` and object
arguments; anything else inside the markers stays content, marker text included: model output
never raises. Arguments are re-serialized compactly (``{"city":"Paris"}``, non-ASCII kept).
Content is the text outside the calls, less the whitespace that only lays calls out (between
content and a call, between calls, after the last call); ``parse`` answers None for content
that is empty or only whitespace.

Streaming is exact: the content fragments that ``feed`` and ``finish`` return, concatenated, equal
the content ``parse`` returns, and the calls are the same in the same order, however the text is
cut into deltas. A possible partial marker (and an undecided call) is held back; content before a
marker streams at once. Each call is sent as one fragment once its JSON is complete.

The markers of ``internlm`` (``<|action_start|>``, ``<|plugin|>``, ``<|action_end|>``) and
``mistral`` (``[TOOL_CALLS]``, ``[ARGS]``, ...) are special tokens of their tokenizers: the
detokenizer must keep them (``skip_special_tokens`` false) for a parser whose
``needs_special_tokens`` is true, or the markers never reach it (``markers`` lists them, to check
a tokenizer's special tokens with; some Hermes fine-tunes make ``<tool_call>`` special too).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from ...protocol.errors import InvalidRequestError

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text of an object, as OpenAI's ``function.arguments``."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an item of a chat message's ``tool_calls``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    """Streamed text that is content (not part of a call)."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A streamed fragment of call ``index``: the first one carries ``id`` and ``name``, later
    ones (if any) only argument text to append."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The fragment as an item of a chunk's ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


ToolDelta = ContentDelta | CallDelta


def finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason for a choice: ``tool_calls`` when it stopped after calling tools.

    A choice cut by ``length`` (or aborted) keeps its reason, so the client can tell that its
    last call may be missing.
    """
    if has_calls and engine_reason in ("stop", None):
        return "tool_calls"
    return engine_reason


def new_call_id() -> str:
    """An id shaped as OpenAI's: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def held_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class JsonEnd:
    """Where the JSON object or array opening at ``text[start]`` closes; None while it is not closed.

    Only brackets outside strings count; whether the value is valid JSON is json.loads' business.
    A look resumes where the last one on the same start stopped (the text only grows between
    looks), so a call streamed in many deltas is scanned once, not once per delta.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the last look (the text it scanned changed)."""
        self._start = self._pos = -1
        self._depth, self._in_string, self._escaped = 0, False, False

    def find(self, text: str, start: int) -> int | None:
        """The end (exclusive) of the value opening at ``start``, or None."""
        if start != self._start:
            self.reset()
            self._start = self._pos = start
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(self._pos, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.reset()
                    return i + 1
        self._pos, self._depth, self._in_string, self._escaped = len(text), depth, in_string, escaped
        return None


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` closes (one look, no memory)."""
    return JsonEnd().find(text, start)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
        return None


def call_from_object(obj: Any, name: str | None = None) -> tuple[str, str] | None:
    """(name, compact arguments JSON) of a decoded call object, or None if it is not one.

    The arguments are ``arguments`` or ``parameters`` (absent: ``{}``); a string holding a JSON
    object is accepted too (some models double-encode them).
    """
    if name is None:
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    else:
        args = obj
    if not isinstance(name, str) or not name:
        return None
    if args is None:
        args = {}
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))


# One step of a parser's scan: what it decided (("text", s) or ("call", name, args, id or None))
# and how many characters of its buffer that consumed.
Event = tuple[Any, ...]
Step = tuple[list[Event], int]


class ToolParser:
    """One output's calls and content; ``feed`` deltas, then ``finish`` (or ``parse`` a whole text).

    A parser holds the state of one streamed output (one choice): make one per choice. Each
    format is a ``_step`` over the undecided text that only decides what further text cannot
    change, which is what makes streaming equal ``parse`` for any cut.
    """

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens: don't skip them
    markers: ClassVar[tuple[str, ...]] = ()  # the marker strings it reads (to check against a tokenizer)

    def __init__(self) -> None:
        self._buf = ""
        self._state = "out"
        self._gap = ""  # the whitespace before the marker of the call being read
        self._json = JsonEnd()  # the open call's JSON, scanned as it grows
        self._searched = 0  # where the next look for a call's end marker starts
        self.calls: list[ToolCall] = []  # the calls completed so far, in order

    @property
    def has_calls(self) -> bool:
        """Whether the output (so far) called a tool: then the finish_reason is ``tool_calls``."""
        return bool(self.calls)

    def new_id(self) -> str:
        """A fresh call id in the format's shape."""
        return new_call_id()

    # ---- whole output ---------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content is None when it is only whitespace."""
        scan = type(self)()
        deltas = scan.feed(text) + scan.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        return (content if content.strip() else None), scan.calls

    # ---- streaming ------------------------------------------------------------------------------

    def feed(self, delta: str) -> list[ToolDelta]:
        """The content and call fragments that one more piece of output text decides."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[ToolDelta]:
        """What is still held back, once the output has ended."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        while True:
            state = self._state
            events, used = self._step(self._buf, final)
            if used:  # positions into the buffer move: the resumable looks start over
                self._buf = self._buf[used:]
                self._json.reset()
                self._searched = 0
            events = [event for event in events if event[0] != "text" or event[1]]
            for event in events:
                if event[0] == "text":
                    if out and isinstance(out[-1], ContentDelta):
                        out[-1] = ContentDelta(out[-1].text + event[1])
                    else:
                        out.append(ContentDelta(event[1]))
                else:
                    call = ToolCall(event[3] or self.new_id(), event[1], event[2])
                    out.append(CallDelta(len(self.calls), call.arguments, call.id, call.name))
                    self.calls.append(call)
            if not used and not events and self._state == state:
                return out  # nothing more is decided until more text (or the end) comes

    def _step(self, buf: str, final: bool) -> Step:
        raise NotImplementedError

    def _scan_out(self, buf: str, final: bool, marker: str) -> Step:
        """Content up to a call ``marker`` (which moves to state ``in``).

        Whitespace between content and a call, between two calls, and after the last call is
        the format's layout, not content: it is held until the next text decides. Whitespace
        between a call and more content is kept, so the content's words stay apart.
        """
        if self._state == "after":
            rest = buf.lstrip()
            if not rest and not final:
                return [], 0
            if not rest or rest.startswith(marker):
                self._state = "out"
                return [], len(buf) - len(rest)
            if marker.startswith(rest) and not final:
                return [], 0
            self._state = "out"
            return [], 0
        at = buf.find(marker)
        if at >= 0:
            text = buf[:at].rstrip()
            self._gap = buf[len(text):at]
            self._state = "in"
            return [("text", text)], at + len(marker)
        if final:
            return [("text", buf)], len(buf)
        text = buf[:len(buf) - held_suffix(buf, marker)].rstrip()
        return [("text", text)], len(text)


class TaggedToolParser(ToolParser):
    """Calls as JSON objects between a start and an end marker, content around them."""

    start: ClassVar[str] = ""
    end: ClassVar[str] = ""

    def _step(self, buf: str, final: bool) -> Step:
        if self._state != "in":
            return self._scan_out(buf, final, self.start)
        at = buf.find(self.end, self._searched)
        if at < 0 and not final:
            self._searched = max(0, len(buf) - len(self.end) + 1)
            return [], 0  # the call is not closed yet
        body, used = (buf[:at], at + len(self.end)) if at >= 0 else (buf, len(buf))
        # A call cut short (no end marker: max_tokens, or a stop word) is still read if complete.
        call = call_from_object(_loads(body.strip()))
        if call is None:
            self._state = "out"
            return [("text", self._gap + self.start + buf[:used])], used
        self._state = "after"
        return [("call", *call, None)], used


class HermesToolParser(TaggedToolParser):
    """Hermes 2 Pro / 3, Qwen2.5, Qwen3: ``<tool_call>{json}</tool_call>``."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)


class InternLMToolParser(TaggedToolParser):
    """InternLM2 / 2.5 / 3: ``<|action_start|><|plugin|>{json}<|action_end|>``."""

    name = "internlm"
    needs_special_tokens = True
    start = "<|action_start|><|plugin|>"
    end = "<|action_end|>"
    markers = ("<|action_start|>", "<|plugin|>", end)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON calls: the output opens with ``{"name": ..., "parameters": ...}``."""

    name = "llama3_json"
    # <|python_tag|> is special; skipped by the detokenizer, the JSON that follows still parses
    markers = ("<|python_tag|>",)
    _LEAD = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")
    _SEP = re.compile(r"\s*(?:;\s*)?")
    _TAG = "<|python_tag|>"

    def _step(self, buf: str, final: bool) -> Step:
        if self._state == "content":
            return [("text", buf)], len(buf)
        first = self._state == "out"
        at = (self._LEAD if first else self._SEP).match(buf).end()
        rest = buf[at:]
        if not rest.startswith("{"):
            undecided = not rest or (first and self._TAG.startswith(rest.lstrip()))
            if undecided and not final:
                return [], 0
            if not first and not rest.strip():
                return [], len(buf)  # separators or whitespace after the last call: not content
            self._state = "content"
            return [], 0
        end = self._json.find(buf, at)
        if end is None and not final:
            return [], 0
        call = call_from_object(_loads(buf[at:end])) if end is not None else None
        if call is None:
            self._state = "content"  # not a call: this text and all after it are content
            return [], 0
        self._state = "after"
        return [("call", *call, None)], end


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{json}, ...]`` or ``[TOOL_CALLS]name[ARGS]{json}``."""

    name = "mistral"
    needs_special_tokens = True
    start = "[TOOL_CALLS]"
    markers = (start, "[ARGS]", "[CALL_ID]")
    # v11+: name, an optional [CALL_ID]id, then [ARGS] (dropped by a detokenizer that skips it)
    _NAMED = re.compile(r"([A-Za-z0-9_.\-]{1,128})(?:\[CALL_ID\]([A-Za-z0-9]{1,64}))?(?:\[ARGS\])?(?=\{)")
    _NAMED_CHARS = frozenset(string.ascii_letters + string.digits + "_.-[]")
    _NAMED_MAX = 220  # longer than any _NAMED match: past it without one, none can come

    def new_id(self) -> str:
        """Mistral's templates refuse any id but 9 letters or digits in the history."""
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def _step(self, buf: str, final: bool) -> Step:
        if self._state != "in":
            return self._scan_out(buf, final, self.start)
        rest = buf.lstrip()
        skipped = len(buf) - len(rest)
        if rest[:1] in ("[", "{"):
            end = self._json.find(buf, skipped)
            if end is None and not final:
                return [], 0
            value = _loads(buf[skipped:end]) if end is not None else None
            items = value if isinstance(value, list) else [value]
            calls = [call_from_object(item) for item in items]
            if end is None or not items or None in calls:
                return self._not_a_call()
            self._state = "after"
            return [("call", *call, None) for call in calls], end
        match = self._NAMED.match(rest)
        if match is None:
            maybe = len(rest) <= self._NAMED_MAX and all(ch in self._NAMED_CHARS for ch in rest)
            if maybe and not final:
                return [], 0
            return self._not_a_call()
        start = skipped + match.end()
        end = self._json.find(buf, start)
        if end is None and not final:
            return [], 0
        call = call_from_object(_loads(buf[start:end]), match.group(1)) if end is not None else None
        if call is None:
            return self._not_a_call()
        self._state = "after"
        return [("call", *call, match.group(2))], end

    def _not_a_call(self) -> Step:
        # The marker is text, and what follows it is scanned again (another marker may follow).
        self._state = "out"
        return [("text", self._gap + self.start)], 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (Llama3JsonToolParser, HermesToolParser, InternLMToolParser, MistralToolParser)
}

# The builtin chat templates (services/tokenizer/chat_template.py) and architectures whose
# models were trained on a format. Llama-architecture models span several formats (Llama 2,
# Vicuna, ...): only their template tells.
_BY_TEMPLATE = {
    "llama3": "llama3_json", "llama3_1": "llama3_json", "llama3_2": "llama3_json",
    "qwen": "hermes", "qwen2": "hermes", "qwen3": "hermes",
    "internlm2": "internlm", "internlm3": "internlm",
    "mistral": "mistral", "mixtral": "mistral",
}
_BY_ARCHITECTURE = {
    "Qwen2ForCausalLM": "hermes", "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes", "Qwen3MoeForCausalLM": "hermes",
    "InternLM2ForCausalLM": "internlm", "InternLM3ForCausalLM": "internlm",
    "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mistral",
}
# A Jinja chat template's own text names its format by the markers it renders.
_BY_TEMPLATE_TEXT = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|action_start|>", "internlm"),
    ("<|python_tag|>", "llama3_json"),
)


def default_tool_parser(architecture_or_template_name: str | None) -> str | None:
    """The parser a builtin chat template's name (``llama3_1``, ``qwen``, ``internlm2``,
    ``mistral``, ...) or an architecture (``Qwen2ForCausalLM``, ...) implies; None when unknown."""
    if not architecture_or_template_name:
        return None
    key = architecture_or_template_name
    return _BY_TEMPLATE.get(key.lower()) or _BY_ARCHITECTURE.get(key)


def tool_parser_for_template_text(template: str | None) -> str | None:
    """The parser a Jinja chat template's source implies by the call markers it renders; None if none."""
    if not template or "tool" not in template:
        return None
    for marker, parser in _BY_TEMPLATE_TEXT:
        if marker in template:
            return parser
    return None


# LMDeploy's names for the same formats (its --tool-call-parser), accepted as well
TOOL_PARSER_ALIASES = {"qwen": "hermes", "qwen2d5": "hermes", "qwen3": "hermes", "llama3": "llama3_json"}


def check_tool_parser(name: str) -> str:
    """The parser ``name`` (or LMDeploy's alias of it) selects, else an error naming the known ones."""
    name = TOOL_PARSER_ALIASES.get(name, name)
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(
            f"unknown tool-call parser {name!r}: choose one of {', '.join(sorted(TOOL_PARSERS))}",
            param="tool_call_parser")
    return name


def make_tool_parser(name: str) -> ToolParser:
    """A fresh parser of format ``name`` for one output."""
    return TOOL_PARSERS[check_tool_parser(name)]()

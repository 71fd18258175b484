"""Reasoning parsers: split a thinking model's output into ``reasoning_content`` and ``content``.

``--reasoning-parser`` picks one by vLLM's name. Both formats wrap the thinking in
``<think> ... </think>``; they differ in where the output starts:

- ``deepseek_r1``: DeepSeek-R1's chat template opens ``<think>`` in the prompt, so the output
  starts inside the reasoning. A ``<think>`` the model prints again at the very start is dropped.
  Text before ``</think>`` is reasoning, text after it is content; an output that never closes
  the thinking (cut by max_tokens) is all reasoning.
- ``qwen3``: Qwen3 prints ``<think>`` itself when it thinks. An output that opens with ``<think>``
  is reasoning up to ``</think>`` (all reasoning if it never closes); any other output is content,
  which is what ``enable_thinking: false`` produces (that template closes an empty think block in
  the prompt). Templates that open ``<think>`` in the prompt themselves (Qwen3-*-Thinking-2507,
  QwQ) start inside the reasoning: ``make_reasoning_parser("qwen3", prompt=...)`` sees that.

As vLLM does, nothing is stripped: the newline(s) a model writes after ``<think>`` or ``</think>``
stay in the reasoning / content text, and an empty part is ``None`` (OpenAI's ``null``).

Streaming is exact: the reasoning and content deltas that ``feed`` and ``finish`` return add up
to what ``split`` returns for the whole text, however the text was cut into deltas, because a
possible partial marker is held back until the next delta decides it.
"""

from __future__ import annotations

from typing import ClassVar

from ...protocol.errors import InvalidRequestError

THINK_START = "<think>"
THINK_END = "</think>"


def held_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (the template opened it)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """One output's split into reasoning and content; ``feed`` deltas, then ``finish``.

    A parser holds the state of one streamed output (one choice): make one per choice.
    ``split`` is stateless and may be called on any instance.
    """

    name: ClassVar[str] = ""
    starts_in_reasoning: ClassVar[bool] = False  # the format's chat template opens <think> itself

    def __init__(self, *, in_reasoning: bool | None = None) -> None:
        # in_reasoning overrides the format's default: True when the prompt left <think> open
        self._default_reasoning = self.starts_in_reasoning if in_reasoning is None else in_reasoning
        self._phase = "start"  # start -> reasoning | content
        self._held = ""

    # ---- whole output ---------------------------------------------------------------------------

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; ``None`` for an empty part."""
        in_reasoning = self._default_reasoning
        if text.startswith(THINK_START):
            text, in_reasoning = text[len(THINK_START):], True
        if not in_reasoning:
            return None, text or None
        reasoning, closed, content = text.partition(THINK_END)
        return reasoning or None, (content if closed else "") or None

    # ---- streaming ------------------------------------------------------------------------------

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one more piece of output text; either may be ''."""
        return self._advance(self._held + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """The held-back tail, once the output has ended."""
        return self._advance(self._held, final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        if self._phase == "start":
            if text.startswith(THINK_START):
                text, self._phase = text[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(text) and not final:
                self._held = text  # '' or a start of <think>: not decided yet
                return "", ""
            else:
                self._phase = "reasoning" if self._default_reasoning else "content"
        if self._phase == "content":
            return "", text
        head, closed, tail = text.partition(THINK_END)
        if closed:
            self._phase = "content"
            return head, tail
        keep = 0 if final else held_suffix(text, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the output starts inside the reasoning."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with ``<think>`` (or the prompt left it open)."""

    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def check_reasoning_parser(name: str) -> str:
    """``name`` if it is a known reasoning parser, else an error naming the known ones."""
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(
            f"unknown reasoning parser {name!r}: choose one of {', '.join(sorted(REASONING_PARSERS))}",
            param="reasoning_parser")
    return name


def make_reasoning_parser(name: str, prompt: str | None = None) -> ReasoningParser:
    """A fresh parser of format ``name`` for one output.

    ``prompt`` (the rendered prompt text), where given, decides whether the output starts inside
    the thinking for ``qwen3`` (a template that opened ``<think>`` itself); ``deepseek_r1`` always
    starts inside it, as vLLM's parser does.
    """
    cls = REASONING_PARSERS[check_reasoning_parser(name)]
    if prompt is not None and not cls.starts_in_reasoning and prompt_opens_thinking(prompt):
        return cls(in_reasoning=True)
    return cls()

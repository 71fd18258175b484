"""A streamed chat completion read back whole, as a client assembles it: the content and
reasoning deltas joined, each tool call's name and argument fragments (by ``index``), and the
finish reasons (the tests' view of OpenAI's chunk protocol, shared by unit and server tests)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedChat:
    content: str = ""
    reasoning: str = ""
    names: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)
    finishes: list[str] = field(default_factory=list)


def gather(chunks: Iterable[Any]) -> StreamedChat:
    """Join the ``openai`` client's chat chunks (one choice's, or several choices' alike)."""
    out = StreamedChat()
    for chunk in chunks:
        for c in chunk.choices:
            out.content += c.delta.content or ""
            out.reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for frag in c.delta.tool_calls or ():
                if frag.function and frag.function.name:
                    out.names[frag.index] = frag.function.name
                out.arguments[frag.index] = (out.arguments.get(frag.index, "")
                                             + ((frag.function and frag.function.arguments) or ""))
            if c.finish_reason:
                out.finishes.append(c.finish_reason)
    return out

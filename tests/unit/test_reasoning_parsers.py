"""Reasoning parsers: deepseek_r1 and qwen3 outputs split whole, and streamed in any cut.

The whole-output splits are written out by hand (vLLM's semantics: nothing stripped, an empty
part is None); streaming must add up to exactly the whole split for every split point into two
deltas, one character at a time, and seeded random chunkings.
"""

from __future__ import annotations


import pytest
from text_chunkings import chunkings

from conveyor.protocol.errors import InvalidRequestError
from conveyor.services.ingress.reasoning_parsers import (
    REASONING_PARSERS,
    make_reasoning_parser,
    prompt_opens_thinking,
)

# (parser, output, reasoning, content)
SAMPLES = [
    # ---- deepseek_r1: the template opened <think> in the prompt ----
    ("deepseek_r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nLet me think.\n</think>\n\nHi!", "\nLet me think.\n", "\n\nHi!"),  # older template
    ("deepseek_r1", "Still thinking when max_tokens ran out", "Still thinking when max_tokens ran out", None),
    ("deepseek_r1", "</think>Just the answer.", None, "Just the answer."),
    ("deepseek_r1", "Thought.</think>", "Thought.", None),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "<think>", None, None),
    ("deepseek_r1", "a < b and </thin k>, then</think> x </think> y", "a < b and </thin k>, then", " x </think> y"),
    ("deepseek_r1", "ends on a partial </thi", "ends on a partial </thi", None),
    ("deepseek_r1", "Hmm <think> again?</think>ok", "Hmm <think> again?", "ok"),  # only a leading <think> is dropped
    ("deepseek_r1", "思考：东京 ☀</think>答案：是的", "思考：东京 ☀", "答案：是的"),
    # ---- qwen3: the model opens <think> itself when it thinks ----
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "\n\n", "\n\nHello!"),
    ("qwen3", "Hello! (enable_thinking: false)", None, "Hello! (enable_thinking: false)"),
    ("qwen3", "<think>\ncut by max_tokens", "\ncut by max_tokens", None),
    ("qwen3", "<think></think>", None, None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "No think here</think> but a stray end", None, "No think here</think> but a stray end"),
    ("qwen3", " <think>not at the start</think>", None, " <think>not at the start</think>"),
    ("qwen3", '<think>\nCall the tool.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     "\nCall the tool.\n", '\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    ("qwen3", "", None, None),
]


def _ids(samples):
    return [f"{name}-{i}" for i, (name, *_rest) in enumerate(samples)]


def _stream(name: str, chunks: list[str], **kwargs) -> tuple[str | None, str | None]:
    parser = make_reasoning_parser(name, **kwargs)
    reasoning = content = ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("name, text, reasoning, content", SAMPLES, ids=_ids(SAMPLES))
def test_split(name, text, reasoning, content):
    assert make_reasoning_parser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", SAMPLES, ids=_ids(SAMPLES))
def test_stream_equals_split_for_any_chunking(name, text, reasoning, content):
    want = make_reasoning_parser(name).split(text)
    for chunks in chunkings(text, seed=len(text)):
        assert _stream(name, chunks) == want, chunks


def test_markers_are_never_leaked_and_text_is_not_held_longer_than_needed():
    parser = make_reasoning_parser("deepseek_r1")
    assert parser.feed("<thi") == ("", "")  # maybe a leading <think>
    assert parser.feed("nk>Let me") == ("Let me", "")
    assert parser.feed(" see </th") == (" see ", "")  # maybe </think>
    assert parser.feed("ink>\n\n") == ("", "\n\n")
    assert parser.feed("Four.") == ("", "Four.")
    assert parser.finish() == ("", "")
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("Hi") == ("", "Hi")  # no <think>: content at once
    assert parser.feed("</think>") == ("", "</think>")
    parser = make_reasoning_parser("deepseek_r1")
    assert parser.feed("a </") == ("a ", "")
    assert parser.feed("b") == ("</b", "")  # the held text was not a marker after all
    assert parser.finish() == ("", "")
    parser = make_reasoning_parser("deepseek_r1")
    assert parser.feed("x </thin") == ("x ", "")
    assert parser.finish() == ("</thin", "")  # the output ended: what was held is reasoning


@pytest.mark.parametrize("prompt, opens", [
    ("<|im_start|>assistant\n<think>\n", True),  # Qwen3-*-Thinking-2507, QwQ
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking: false
    ("<|im_start|>assistant\n", False),  # Qwen3, thinking on: the model opens <think>
    ("<｜Assistant｜><think>\n", True),  # DeepSeek-R1
    ("", False),
])
def test_prompt_opens_thinking(prompt, opens):
    assert prompt_opens_thinking(prompt) is opens


def test_qwen3_after_a_prompt_that_opened_think():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    text = "The user says hi.\n</think>\n\nHello!"
    parser = make_reasoning_parser("qwen3", prompt=prompt)
    assert parser.split(text) == ("The user says hi.\n", "\n\nHello!")
    for chunks in chunkings(text, seed=1):
        assert _stream("qwen3", chunks, prompt=prompt) == ("The user says hi.\n", "\n\nHello!")
    # the same output without that prompt is content: the model never opened a think block
    assert make_reasoning_parser("qwen3").split(text) == (None, text)
    # enable_thinking: false renders a closed block: the output is content
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert make_reasoning_parser("qwen3", prompt=closed).split("Hello!") == (None, "Hello!")
    # deepseek_r1 starts inside the reasoning whatever the prompt
    assert make_reasoning_parser("deepseek_r1", prompt="").split("a</think>b") == ("a", "b")


def test_each_parser_is_one_output():
    one, two = make_reasoning_parser("deepseek_r1"), make_reasoning_parser("deepseek_r1")
    assert one.feed("r</think>c") == ("r", "c")
    assert two.feed("r2") == ("r2", "")
    assert one.split("x</think>y") == ("x", "y")  # split does not touch the stream's state
    assert one.feed("more") == ("", "more")


def test_registry_and_errors():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name in REASONING_PARSERS:
        assert make_reasoning_parser(name).name == name
    with pytest.raises(InvalidRequestError, match="choose one of deepseek_r1, qwen3"):
        make_reasoning_parser("granite")
    with pytest.raises(ValueError):
        make_reasoning_parser("DeepSeek_R1")


def test_reasoning_then_tool_calls_as_the_route_chains_them():
    # the reasoning parser first; its content deltas feed the tool-call parser
    from conveyor.services.ingress.tool_parsers import CallDelta, ContentDelta, make_tool_parser

    text = ('<think>\nThe user wants the weather; I could write <tool_call> here.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    for chunks in chunkings(text, seed=3):
        reasoner, tools = make_reasoning_parser("qwen3"), make_tool_parser("hermes")
        reasoning, content, calls = "", "", []
        for chunk in [*chunks, None]:
            r, c = reasoner.feed(chunk) if chunk is not None else reasoner.finish()
            reasoning += r
            deltas = tools.feed(c) + (tools.finish() if chunk is None else [])
            content += "".join(d.text for d in deltas if isinstance(d, ContentDelta))
            calls += [(d.name, d.arguments) for d in deltas if isinstance(d, CallDelta)]
        assert reasoning == "\nThe user wants the weather; I could write <tool_call> here.\n"
        assert (content, calls) == ("", [("get_weather", '{"city":"Paris"}')])

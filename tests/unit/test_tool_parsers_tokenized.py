"""Each tool-call format through a tokenizer that carries it, as the server reads a model's output:
token ids -> the detokenizer (one token at a time, special tokens kept exactly when the parser
asks for them, as the chat route sets ``skip_special_tokens``) -> the parser's streamed deltas.

The tokenizer is SmolLM2's with each format's markers added the way the real models' tokenizers
have them: InternLM2's ``<|action_start|>`` / ``<|plugin|>`` / ``<|action_end|>`` and Mistral's
``[TOOL_CALLS]`` / ``[ARGS]`` as special tokens, Qwen's ``<tool_call>`` / ``</tool_call>`` as
ordinary added tokens, Llama 3's ``<|python_tag|>`` as a special token it may skip.
"""

from __future__ import annotations

import json

import pytest

from conveyor.services.detokenizer.incremental import IncrementalDetokenizer
from conveyor.services.ingress.tool_parsers import CallDelta, ContentDelta, make_tool_parser

ARGS = {"city": "Paris", "days": 3}
CASES = {
    "hermes": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>' % json.dumps(ARGS),
               "I will check."),
    "internlm": ("I will check.<|action_start|><|plugin|>\n"
                 '{"name": "get_weather", "parameters": %s}<|action_end|>' % json.dumps(ARGS), "I will check."),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": %s}]' % json.dumps(ARGS), None),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": %s}' % json.dumps(ARGS), None),
}
SPECIAL = ["<|action_start|>", "<|plugin|>", "<|action_end|>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
ADDED = ["<tool_call>", "</tool_call>"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.add_tokens(ADDED)
    return tok


def _stream(tokenizer, text: str, parser_name: str, skip_special_tokens: bool):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    parser = make_tool_parser(parser_name)
    deltas = []
    for t in ids:
        deltas += parser.feed(detok.step([t]).text)
    deltas += parser.feed(detok.finish()) + parser.finish()
    return ids, deltas


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_call_survives_tokenizing_and_detokenizing(tokenizer, name) -> None:
    text, content = CASES[name]
    parser = make_tool_parser(name)
    ids, deltas = _stream(tokenizer, text, name, skip_special_tokens=not parser.needs_special_tokens)
    markers = [m for m in SPECIAL + ADDED if m in text]
    # The markers really are single tokens of this tokenizer (else the test would prove nothing).
    assert all(tokenizer.convert_tokens_to_ids(m) in ids for m in markers)
    calls = [d for d in deltas if isinstance(d, CallDelta)]
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments or "" for c in calls)) == ARGS
    streamed = "".join(d.text for d in deltas if isinstance(d, ContentDelta)).strip() or None
    assert streamed == content


@pytest.mark.parametrize("name", ["internlm", "mistral"])
def test_skipping_special_tokens_would_hide_the_call(tokenizer, name) -> None:
    """Why the route keeps special tokens for these parsers: skipped, the markers are gone and
    the call reads as plain text."""
    assert make_tool_parser(name).needs_special_tokens
    _, deltas = _stream(tokenizer, CASES[name][0], name, skip_special_tokens=True)
    assert not any(isinstance(d, CallDelta) for d in deltas)

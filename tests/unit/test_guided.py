"""Output constraints' pieces: the Guide readings (protocol/guided.py), the tokenizer stage's
syntax check, the token mask (engine/grammar.py) and the scheduler passing over a turn whose
grammar still compiles."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.grammar import GuideState, apply_token_bitmask, fill_token_bitmask
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence
from conveyor.protocol import InvalidRequestError
from conveyor.protocol.guided import Guide, guide_from_fields, guide_from_response_format
from conveyor.protocol.sampling import SamplingParams, validate
from conveyor.services.tokenizer.guide_syntax import check_guide_syntax

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_response_format_readings() -> None:
    assert guide_from_response_format(None) is None
    assert guide_from_response_format({"type": "text"}) is None
    assert guide_from_response_format({"type": "json_object"}) == Guide("json_object")
    g = guide_from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                         "strict": True}})
    assert g.kind == "json_schema" and json.loads(g.spec) == SCHEMA
    # The schema as text or as an object is one cache key.
    assert guide_from_fields("guided_json", json.dumps(SCHEMA)) == guide_from_fields("guided_json", SCHEMA)
    assert guide_from_response_format({"type": "regex_schema", "regex_schema": "a+"}) == Guide("regex", "a+")
    assert guide_from_fields("guided_choice", ["x", "y"]) == Guide("choice", '["x", "y"]')
    assert guide_from_fields("structured_outputs.grammar", 'root ::= "a"') == Guide("grammar", 'root ::= "a"')


@pytest.mark.parametrize("bad, words", [
    ({"type": "json_schema"}, "json_schema needs"),
    ({"type": "json_schema", "json_schema": {"schema": "{nope"}}, "not valid JSON"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "is an object"),
    ({"type": "yaml"}, "not one of"),
    ("json", "an object with a 'type'"),
])
def test_bad_response_formats_name_the_problem(bad, words) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        guide_from_response_format(bad)


def test_validate_checks_the_guide_and_refuses_ignore_eos() -> None:
    with pytest.raises(InvalidRequestError, match="choice must be"):
        validate(SamplingParams(guide=Guide("choice", '["", "x"]')))
    with pytest.raises(InvalidRequestError, match="unknown kind"):
        validate(SamplingParams(guide=Guide("xml", "x")))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        validate(SamplingParams(ignore_eos=True, guide=Guide("json_object")))


@pytest.mark.parametrize("guide, words", [
    (Guide("json_schema", json.dumps({"type": "strin"})), "json schema is invalid"),
    (Guide("regex", "(ab"), "regex is invalid: .*parenthesis"),
    (Guide("grammar", 'root ::= "a" | b'), 'grammar is invalid: .*"b" is not defined'),
])
def test_syntax_check_turns_parse_errors_into_400s(guide, words) -> None:
    with pytest.raises(InvalidRequestError, match=words) as info:
        check_guide_syntax(guide)
    assert "/project/cpp" not in str(info.value)  # xgrammar's source position is not the client's business
    check_guide_syntax(Guide("json_schema", json.dumps(SCHEMA)))
    check_guide_syntax(Guide("regex", "[0-9]+"))


def test_apply_token_bitmask_matches_a_plain_loop() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    words = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int64)
    for r in range(3):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    expected = torch.where(allowed, logits, torch.tensor(float("-inf")))
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), expected)


def _ready(value=None, error=None) -> Future:
    f: Future = Future()
    if error is not None:
        f.set_exception(error)
    elif value is not None:
        f.set_result(value)
    return f


def test_fill_token_bitmask_is_none_without_constrained_rows() -> None:
    assert fill_token_bitmask([None, None], 64) is None


def test_scheduler_passes_over_a_turn_whose_grammar_compiles() -> None:
    bm = BlockManager(16, 4, False)
    sched = Scheduler(bm, max_batch_size=8, max_num_tokens=64, session_len=64)
    compiling = Sequence([1, 2, 3], SamplingParams())
    compiling.guide_state = GuideState(_ready(), [0])  # not done
    free = Sequence([4, 5, 6], SamplingParams())
    failed = Sequence([7, 8], SamplingParams())
    failed.guide_state = GuideState(_ready(error=RuntimeError("bad")), [0])
    for s in (compiling, free, failed):
        sched.add(s)
    out = sched.schedule()
    assert [item.seq for item in out.scheduled] == [free]
    assert list(sched.waiting) == [compiling, failed]  # the engine ends the failed one
    compiling.guide_state.compiled.set_result(object())
    again = [item.seq for item in sched.schedule().scheduled]
    assert compiling in again and failed not in again

"""No message a peer stage can send ends a stage (issue 28, finding 5).

Each class of field, sent with values the wire types allow but the stage cannot use: a request
is refused with a 400 naming the field, sent to its ``reply_to``; any other message is dropped
whole. The stage keeps serving the request sent beside the bad one, and no KV block leaks.

The engine cases run the real engine's handler (``stage_harness.EngineStage``) on a tiny
dummy-weight Llama; the detokenizer and tokenizer cases use the test model's tokenizer.
"""

from __future__ import annotations

import math

import pytest
from conveyor.protocol import (
    Abort,
    Admitted,
    CancelSession,
    ErrorOut,
    Finish,
    GenerateReq,
    InvalidRequestError,
    SamplingParams,
    SessionEnd,
    StopReq,
    TokenBatch,
    TokenizedReq,
    validate,
)
from conveyor.protocol.checks import MalformedMessageError, check_text_batch
from conveyor.protocol.messages import TextBatch
from conveyor.services.detokenizer.batches import Detokenizer
from stage_harness import REPLY, VOCAB, EngineStage, tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

U64 = 2**64 - 1  # the largest integer msgpack carries
GOOD = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture
def engine(tmp_path):
    return tiny_engine(tmp_path)  # a few milliseconds: each test gets its own


@pytest.fixture
def stage(engine):
    s = EngineStage(engine)
    yield s
    s.assert_idle_and_empty()


def _req(rid: str, params: SamplingParams = GOOD, ids: list[int] | None = None, **kw) -> TokenizedReq:
    return TokenizedReq(rid, REPLY, [5, 17, 33, 2] if ids is None else ids, params, **kw)


def _refused_beside_a_good_request(stage: EngineStage, bad: TokenizedReq, param: str) -> None:
    """``bad`` gets a 400 naming ``param``; the request sent with it (and one sent after) run."""
    stage.handle([_req("before"), bad, _req("after", params=SamplingParams(max_new_tokens=3, temperature=0.7,
                                                                           top_k=5, random_seed=1))])
    stage.run()
    err = stage.errors().get(bad.rid)
    assert err is not None, f"{bad.rid} was not refused"
    assert (err.status, err.param, err.reply_to) == (400, param, REPLY), err
    assert bad.rid not in stage.admitted()
    for rid, n in (("before", 4), ("after", 3)):
        assert stage.finish(rid) == Finish.LENGTH and len(stage.tokens(rid)) == n
    assert all(0 <= t < VOCAB for t in stage.tokens("after"))


# ---- the engine: token ids of every kind -----------------------------------------------------------

def _prefixes(last: int) -> list[list[int]]:
    """A bad sequence after every possible token, so that the ban is looked at on the 2nd step."""
    return [[t, last] for t in range(VOCAB)]


@pytest.mark.parametrize("params, param", [
    (SamplingParams(max_new_tokens=4, bad_sequences=_prefixes(10**6)), "bad_sequences"),  # was an IndexError
    (SamplingParams(max_new_tokens=4, bad_sequences=_prefixes(-1000)), "bad_sequences"),  # was an IndexError
    (SamplingParams(max_new_tokens=4, bad_sequences=_prefixes(-1)), "bad_sequences"),  # banned id 127 instead
    (SamplingParams(max_new_tokens=4, bad_sequences=[[3, VOCAB]]), "bad_sequences"),
    (SamplingParams(max_new_tokens=4, bad_sequences=[[]]), "bad_sequences"),  # was silently ignored
    (SamplingParams(max_new_tokens=4, bad_sequences=[[9]]), "bad_sequences"),
    (SamplingParams(max_new_tokens=4, stop_token_ids=[VOCAB]), "stop_token_ids"),
    (SamplingParams(max_new_tokens=4, bad_token_ids=[U64]), "bad_token_ids"),
    (SamplingParams(max_new_tokens=4, bad_token_ids=[-1]), "bad_token_ids"),
], ids=["seq-huge", "seq-negative", "seq-minus-one", "seq-vocab", "seq-empty", "seq-one-token", "stop-vocab",
        "bad-u64", "bad-negative"])
def test_sampling_token_ids_outside_the_vocabulary_are_refused(stage, params, param) -> None:
    _refused_beside_a_good_request(stage, _req("bad", params), param)


@pytest.mark.parametrize("kw, param", [
    (dict(ids=[5, VOCAB]), "input_ids"),
    (dict(ids=[5, -1]), "input_ids"),
    (dict(first_turn_ids=[1, U64]), "first_turn_ids"),
    # The first-turn rendering is not the one used here, but a peer that sends junk gets told.
    (dict(ids=[U64], first_turn_ids=[1, 2, 3]), "input_ids"),
    (dict(ids=[], first_turn_ids=[]), "prompt"),
], ids=["prompt-vocab", "prompt-negative", "first-turn-u64", "prompt-u64-beside-first-turn", "empty"])
def test_prompt_token_ids_of_every_kind_are_checked(stage, kw, param) -> None:
    _refused_beside_a_good_request(stage, _req("bad", **kw), param)


# ---- the engine: counts and sizes --------------------------------------------------------------------

@pytest.mark.parametrize("params, param", [
    # top_k joins the other rows' top_k in one int64 tensor: 2**64 - 1 made the step raise.
    (SamplingParams(max_new_tokens=4, temperature=0.7, top_k=U64), "top_k"),
    (SamplingParams(max_new_tokens=4, top_k=-1), "top_k"),
    (SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SamplingParams(max_new_tokens=U64), "max_new_tokens"),
    (SamplingParams(max_new_tokens=4, min_new_tokens=-1), "min_new_tokens"),
    (SamplingParams(max_new_tokens=4, min_new_tokens=U64), "min_new_tokens"),
    (SamplingParams(max_new_tokens=4, logprobs=21), "logprobs"),
    (SamplingParams(max_new_tokens=4, logprobs=-1), "logprobs"),
], ids=["top_k-u64", "top_k-negative", "max-zero", "max-u64", "min-negative", "min-u64", "logprobs-21",
        "logprobs-negative"])
def test_counts_out_of_range_are_refused(stage, params, param) -> None:
    _refused_beside_a_good_request(stage, _req("bad", params), param)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=2**63 - 1, temperature=0.7, top_k=2**31 - 1, random_seed=U64),
    SamplingParams(max_new_tokens=2**63 - 1, min_new_tokens=2**63 - 1, stop_token_ids=[1, 2], random_seed=-(2**63)),
    SamplingParams(max_new_tokens=3, temperature=1e-8, top_k=0, top_p=1e-300, logprobs=20),
    SamplingParams(max_new_tokens=3, temperature=1e6, top_k=0, min_p=1.0, repetition_penalty=100.0),
    SamplingParams(max_new_tokens=3, temperature=0.9, top_k=0, min_p=0.0, repetition_penalty=0.01, logprobs=0),
], ids=["largest-counts", "largest-min", "smallest-floats", "largest-floats", "smallest-penalty"])
def test_the_extremes_of_every_range_are_served(stage, params) -> None:
    """The ranges' ends are requests like any other: they run, to session_len if need be."""
    stage.handle([_req("edge", params), _req("beside")])
    stage.run()
    assert not stage.errors()
    assert stage.finish("edge") == Finish.LENGTH and stage.tokens("edge")
    assert all(0 <= t < VOCAB for t in stage.tokens("edge"))
    assert len(stage.tokens("beside")) == 4


def test_seeds_that_do_not_fit_64_bits_are_refused_at_every_entry() -> None:
    """Over the wire a seed is at most 64 bits; the pipeline's Python ints are not."""
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(InvalidRequestError, match="random_seed") as info:
            validate(SamplingParams(random_seed=seed))
        assert info.value.param == "random_seed"


# ---- the engine: floats ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("temperature", 1e-320),  # float32 makes it 0: logits / 0 gave inf and NaN
    ("temperature", 1e300),  # float32 makes it inf: every logit became 0 or NaN
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -math.inf),
    ("min_p", math.nan), ("min_p", -0.1), ("min_p", 1.01),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("repetition_penalty", 0.0),
    ("repetition_penalty", -2.0),
])
def test_floats_out_of_range_nan_and_infinite_are_refused(stage, field, value) -> None:
    params = SamplingParams(**{**dict(max_new_tokens=4, temperature=0.7, top_k=0), field: value})
    _refused_beside_a_good_request(stage, _req("bad", params), field)


# ---- the engine: session ids and priorities ---------------------------------------------------------------

@pytest.mark.parametrize("kw, param", [
    (dict(session_id=U64), "session_id"), (dict(session_id=2**63), "session_id"),
    (dict(priority=U64), "priority"), (dict(priority=2**63), "priority"),
])
def test_session_ids_and_priorities_must_fit_64_bits(stage, kw, param) -> None:
    _refused_beside_a_good_request(stage, _req("bad", **kw), param)


def test_any_64_bit_session_id_and_priority_is_served(stage) -> None:
    stage.handle([_req("low", priority=-(2**63), session_id=-(2**63)),
                  _req("high", priority=2**63 - 1, session_id=2**63 - 1)])
    stage.run()
    assert not stage.errors() and stage.finish("low") == stage.finish("high") == Finish.LENGTH
    stage.handle([SessionEnd(-(2**63)), SessionEnd(2**63 - 1)])


# ---- the engine: messages that are not requests ------------------------------------------------------------

def test_aborts_stops_and_session_ends_of_anything_are_harmless(stage) -> None:
    stage.handle([_req("live", SamplingParams(max_new_tokens=30, temperature=0.0), session_id=7)])
    stage.step(2)
    junk = [Abort(""), Abort("x" * 10_000), StopReq("nobody"), CancelSession(U64), SessionEnd(-(2**63)),
            CancelSession(0), SessionEnd(12345)]
    stage.handle(junk)
    stage.run()
    assert stage.finish("live") == Finish.LENGTH
    stage.handle([SessionEnd(7)])


def test_a_message_the_engine_fails_to_apply_is_dropped_and_the_loop_goes_on(stage, monkeypatch, caplog) -> None:
    """The handler's guard: whatever raises while a message is applied stays in the log."""
    def broken(request_id: str) -> None:
        raise RuntimeError("abort failed")

    monkeypatch.setattr(stage.engine, "abort", broken)
    stage.handle([Abort("a"), _req("next")])  # the request behind the bad message is still applied
    stage.run()
    assert stage.finish("next") == Finish.LENGTH
    assert "dropped a Abort that could not be applied" in caplog.text


# ---- the detokenizer ------------------------------------------------------------------------------------------

class _SlowTokenizer:
    """A tokenizer whose decode raises on an id it does not know (as slow, SentencePiece ones do)."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids)


@pytest.fixture
def detok() -> Detokenizer:
    return Detokenizer(_SlowTokenizer([f"<{i}>" for i in range(10)]))


def _admit(detok: Detokenizer, rid: str, **kw) -> None:
    assert detok.admit(Admitted(rid, REPLY, 3, SamplingParams().detokenize_params(), [1, 2], **kw)) == []


def _text(batches: dict) -> list[str]:
    return batches[REPLY].texts if REPLY in batches else []


@pytest.mark.parametrize("batch", [
    TokenBatch(["a", "b"], [1], [-1, -1], [0, 0]),  # ragged: was applied to "a", then an IndexError
    TokenBatch(["a", "b"], [1, 2], [-1], [0, 0]),
    TokenBatch(["a", "b"], [1, 2], [-1, -1], [0, 0, 0]),
    TokenBatch(["a", "b"], [1, 2], [-1, -1], [0, 0], logprobs=[0.0]),
    TokenBatch(["a", "b"], [1, 2], [-1, -1], [0, 0], logprobs=[0.0, 0.0], top_logprobs=[[]]),
    TokenBatch(["a", "b"], [1, 2], [-1, 99], [0, 0]),  # no such Finish: the ingress's Finish(99) raised
    TokenBatch(["a", "b"], [1, 2**40], [-1, -1], [0, 0]),  # a tokenizer's decode raises past 2**32
    TokenBatch(["a", "b"], [1, -7], [-1, -1], [0, 0]),
    TokenBatch(["a", "b"], [1, 2], [-1, -1], [0, -3]),
    TokenBatch(["a"], [1], [-1], [0], [0.0], [[(1, 0.0)] * 21]),
    TokenBatch(["a"], [1], [-1], [0], [0.0], [[(U64, 0.0)]]),
], ids=["tokens", "finish", "cached", "logprobs", "top_logprobs", "finish-99", "token-2**40", "token-negative",
        "cached-negative", "top-21", "top-id-u64"])
def test_a_malformed_token_batch_is_dropped_whole(detok, batch) -> None:
    _admit(detok, "a")
    _admit(detok, "b")
    with pytest.raises(MalformedMessageError):
        detok.process(batch)
    # Nothing of it was applied: both requests go on from where they were.
    batches, _ = detok.process(TokenBatch(["a", "b"], [3, 4], [-1, int(Finish.LENGTH)], [0, 0]))
    assert _text(batches) == ["<3>", "<4>"] and batches[REPLY].completion_tokens == [1, 1]
    assert list(detok.states) == ["a"]


def test_ids_the_tokenizer_does_not_know_render_as_no_text(detok) -> None:
    """A model's vocabulary can be larger than its tokenizer's (padded embeddings)."""
    assert detok.admit(Admitted("a", REPLY, 3, SamplingParams().detokenize_params(), [1, 500, 2])) == []
    batches, _ = detok.process(TokenBatch(["a", "a", "a"], [4, 10, 5], [-1, -1, int(Finish.LENGTH)], [0, 0, 0]))
    assert "".join(_text(batches)) == "<4><5>" and batches[REPLY].completion_tokens[-1] == 3


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_stop_token_a_turn_ends_on_is_not_text(detok, include_stop) -> None:
    """The engine ends a turn with STOP on a stop token id: it counts, but its text is not the
    answer's (with skip_special_tokens off, an <|im_end|> would show), unless
    include_stop_str_in_output asks for stops in the output."""
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include_stop)
    assert detok.admit(Admitted("a", REPLY, 3, params.detokenize_params(), [1, 2])) == []
    batches, _ = detok.process(TokenBatch(["a", "a", "a"], [4, 6, 9], [-1, -1, int(Finish.STOP)], [0, 0, 0]))
    assert "".join(_text(batches)) == ("<4><6><9>" if include_stop else "<4><6>")
    assert batches[REPLY].completion_tokens[-1] == 3 and batches[REPLY].token_ids[-1] == [9]


@pytest.mark.parametrize("msg", [
    Admitted("a", REPLY, -1, SamplingParams().detokenize_params(), [1]),
    Admitted("a", REPLY, 3, SamplingParams().detokenize_params(), [1], history_tokens=-1),
    Admitted("a", REPLY, 3, SamplingParams().detokenize_params(), [U64]),
    # An empty stop string matches everywhere.
    Admitted("a", REPLY, 3, SamplingParams(stop_words=[""]).detokenize_params()),
], ids=["prompt-negative", "history-negative", "tail-u64", "empty-stop"])
def test_a_malformed_admission_starts_nothing(detok, msg) -> None:
    with pytest.raises(MalformedMessageError):
        detok.admit(msg)
    assert not detok.states


@pytest.mark.parametrize("batch", [
    TextBatch(["a", "b"], ["x"], [[1], [2]], [-1, -1], [3, 3], [1, 1], [0, 0]),
    TextBatch(["a"], ["x"], [[1]], [7], [3], [1], [0]),
    TextBatch(["a"], ["x"], [[1]], [-1], [-3], [1], [0]),
    TextBatch(["a"], ["x"], [[1]], [-1], [3], [1], [0], logprobs=[None, None]),
], ids=["ragged", "finish-7", "negative-count", "logprobs"])
def test_text_batch_checks_for_the_ingress(batch) -> None:
    with pytest.raises(MalformedMessageError):
        check_text_batch(batch)
    check_text_batch(TextBatch(["a"], ["x"], [[1]], [int(Finish.STOP)], [3], [1], [0], logprobs=[None]))


# ---- the tokenizer ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def preprocessor(smollm2_dir):
    from conveyor.services.tokenizer.preprocess import Preprocessor

    return Preprocessor(smollm2_dir, 256)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": 5}],  # the template raised TypeError: a 500, not a 400
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [1, 2]}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    [{"role": 7, "content": "hi"}],
    [{"role": ["user"], "content": "hi"}],
    [{"role": "user"}],
], ids=["int", "none", "list-of-ints", "part-text-int", "role-int", "role-list", "no-content"])
def test_messages_that_are_not_text_are_refused_by_the_tokenizer(preprocessor, messages) -> None:
    req = GenerateReq("r", REPLY, SamplingParams(), messages=messages)
    with pytest.raises(InvalidRequestError) as info:
        preprocessor.prepare(req)
    assert info.value.param == "messages"


def test_the_tokenizer_checks_bad_sequences_it_is_sent(preprocessor) -> None:
    req = GenerateReq("r", REPLY, SamplingParams(bad_sequences=[[1, 10**9]]), prompt="hi")
    with pytest.raises(InvalidRequestError) as info:
        preprocessor.prepare(req)
    assert info.value.param == "bad_sequences"


def test_an_error_out_with_a_status_that_is_no_http_error_is_dropped() -> None:
    from conveyor.protocol.checks import check_error_out

    for status in (0, 200, 399, 600, U64):
        with pytest.raises(MalformedMessageError):
            check_error_out(ErrorOut("r", status, "x"))
    check_error_out(ErrorOut("r", 400, "x"))

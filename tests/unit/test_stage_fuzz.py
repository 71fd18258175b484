"""Fuzz each stage's input union with adversarial values (issue 28, finding 5).

For the tokenizer, the engine and the detokenizer: a few hundred messages of the stage's input
union, built from a fixed seed out of values the wire types allow but no honest peer sends
(NaN, infinities, 64-bit ints, ids outside every vocabulary, empty and ragged lists, strings
that are no address), go through the stage's codec and its handler. Nothing may raise out;
every refusal is a 400 (a typed error, never an internal one); nothing malformed is passed on;
and a normal request afterwards is served exactly as on a fresh stage, with no KV block left.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time

import msgspec
import pytest
import zmq
from conveyor.protocol import (
    Abort,
    Addresses,
    Admitted,
    CancelSession,
    Codec,
    ConveyorError,
    DetokenizerIn,
    EngineIn,
    ErrorOut,
    Finish,
    GenerateReq,
    IngressIn,
    LoadReport,
    Ping,
    SamplingParams,
    SessionEnd,
    StopReq,
    TextBatch,
    TokenBatch,
    TokenizedReq,
    TokenizerIn,
)
from conveyor.protocol.checks import (
    check_admitted,
    check_error_out,
    check_text_batch,
    check_token_batch,
)
from stage_harness import REPLY, VOCAB, EngineStage, tiny_engine

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SEED = 28_05
CASES = 300
U64 = 2**64 - 1
INTS = [0, 1, -1, 2, 3, 7, VOCAB - 1, VOCAB, 49_151, 49_152, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63,
        -(2**63), U64]
FLOATS = [0.0, -0.0, 0.5, 0.7, 1.0, 2.0, -1.0, 1e-320, 1e-8, 1e6, 1e300, math.nan, math.inf, -math.inf]
STRS = ["", "x", "\x00", "🙂", "\ufffd", "a" * 5000, "inproc://elsewhere", "tcp://1.2.3.4:5", REPLY]


class Adversary:
    """Values and messages drawn from one seeded generator; ``ok_ids`` bounds the valid ids."""

    def __init__(self, seed: int, ok_ids: int, rids: list[str], reply: str):
        self.r = random.Random(seed)
        self.ok_ids, self.rids, self.reply = ok_ids, rids, reply

    def int(self) -> int:
        return self.r.choice(INTS) if self.r.random() < 0.6 else self.r.randint(-3, 50)

    def float(self) -> float:
        return self.r.choice(FLOATS) if self.r.random() < 0.7 else self.r.uniform(-2, 3)

    def str(self) -> str:
        return self.r.choice(STRS)

    def ids(self, lengths: tuple[int, ...] = (0, 1, 2, 3, 5, 12)) -> list[int]:
        n = self.r.choice(lengths)
        return [self.int() if self.r.random() < 0.15 else self.r.randrange(self.ok_ids) for _ in range(n)]

    def rid(self) -> str:
        """A request id seen before (an abort of a live request, a resend) or an odd one."""
        return self.r.choice(self.rids) if self.r.random() < 0.8 else self.str()

    def new_rid(self) -> str:
        """Mostly a fresh id (the engine admits an id once: a resend is ignored)."""
        if self.r.random() < 0.1:
            return self.rid()
        self.rids.append(f"q{len(self.rids)}")
        return self.rids[-1]

    def reply_to(self) -> str:
        return self.reply if self.r.random() < 0.8 else self.str()

    def bad_sequences(self) -> list[list[int]]:
        """Random entries, or one after every token (a ban then applies at the second step)."""
        if self.r.random() < 0.5:
            return [self.ids() for _ in range(self.r.randint(0, 4))]
        last = self.int()
        return [[t, last] for t in range(min(self.ok_ids, 256))]

    def params(self) -> SamplingParams:
        """A valid request's parameters with none, one or several fields made adversarial."""
        r = self.r
        values = dict(max_new_tokens=r.randint(1, 6), temperature=r.choice([0.0, 0.7]), top_k=r.choice([0, 1, 5]),
                      random_seed=r.choice([None, 1, 2]))
        fields = {
            "max_new_tokens": self.int, "min_new_tokens": self.int, "temperature": self.float,
            "top_k": self.int, "top_p": self.float, "min_p": self.float, "repetition_penalty": self.float,
            "ignore_eos": lambda: r.random() < 0.5, "random_seed": lambda: r.choice([None, self.int()]),
            "stop_words": lambda: [self.str() for _ in range(r.randint(0, 3))],
            "bad_words": lambda: [self.str() for _ in range(r.randint(0, 3))],
            "stop_token_ids": self.ids, "bad_token_ids": self.ids,
            "bad_sequences": self.bad_sequences,
            "logprobs": lambda: r.choice([None, self.int()]),
            "skip_special_tokens": lambda: r.random() < 0.5, "include_stop_str_in_output": lambda: r.random() < 0.5,
        }
        for name in r.sample(sorted(fields), r.choice([0, 1, 1, 2, 4])):
            values[name] = fields[name]()
        return SamplingParams(**values)


def _wire(codec: Codec, msg: msgspec.Struct):
    """``msg`` as the receiving stage decodes it (None: the codec drops it, which is its job)."""
    try:
        return codec.decode(codec.encode(msg))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


# ---- the engine -----------------------------------------------------------------------------------------

def _engine_message(a: Adversary):
    r = a.r
    kind = r.choices(["req", "abort", "stop", "cancel", "end", "ping"], weights=[10, 2, 2, 1, 1, 1])[0]
    session = lambda: r.choice([None, 0, 1, 2, 3, a.int()])
    if kind == "req":
        return TokenizedReq(a.new_rid(), a.reply_to(), a.ids((1, 1, 3, 5, 12, 0)), a.params(), session_id=session(),
                            first_turn_ids=r.choice([None, a.ids()]), priority=r.choice([0, 0, 1, a.int()]))
    if kind == "abort":
        return Abort(a.rid())
    if kind == "stop":
        return StopReq(a.rid())
    if kind == "cancel":
        return CancelSession(session() or 0)
    if kind == "end":
        return SessionEnd(session() or 0)
    return Ping(a.reply_to(), a.float(), {a.str(): a.float()})


def test_the_engine_stage_survives_adversarial_messages(tmp_path) -> None:
    stage = EngineStage(tiny_engine(tmp_path))
    normal = TokenizedReq("normal", REPLY, [5, 17, 33, 2, 90], SamplingParams(max_new_tokens=6, temperature=0.0))
    stage.handle([normal])
    stage.run()
    expected = stage.tokens("normal")
    stage.sent.clear()

    a = Adversary(SEED, VOCAB, ["normal"], REPLY)
    sent, sessions = 0, set()
    while sent < CASES:
        msgs = [_engine_message(a) for _ in range(a.r.randint(1, 8))]
        sent += len(msgs)
        sessions |= {m.session_id for m in msgs if getattr(m, "session_id", None) is not None}
        stage.handle(msgs)  # raises nothing: a pytest failure otherwise
        stage.step(a.r.randint(0, 3))
    stage.run()
    stage.handle([SessionEnd(s) for s in sessions if -(2**63) <= s < 2**63])

    errors = [m for m in stage.sent if isinstance(m, ErrorOut)]
    assert errors and stage.admitted(), "the fuzz should exercise both refusals and admissions"
    assert all(e.status == 400 and e.param for e in errors), [e for e in errors if e.status != 400][:3]
    for m in stage.sent:  # what the engine sends passes the detokenizer's checks
        if isinstance(m, TokenBatch):
            check_token_batch(m)
        elif isinstance(m, Admitted):
            check_admitted(m)
    stage.assert_idle_and_empty()

    stage.sent.clear()
    stage.handle([msgspec.structs.replace(normal, rid="normal-after")])  # a resent rid would be ignored
    stage.run()
    assert stage.tokens("normal-after") == expected and stage.finish("normal-after") == Finish.LENGTH
    stage.assert_idle_and_empty()


# ---- the tokenizer ------------------------------------------------------------------------------------

ROLES = ["user", "system", "assistant", "tool", "x", 7, None, ["user"]]
CONTENTS = ["hi", "", 5, None, [], [{"type": "text", "text": "hi"}], [{"type": "image_url"}], [{"text": 5}],
            [3], {"a": 1}, "🙂" * 50, 1.5]


def _tokenizer_message(a: Adversary) -> GenerateReq:
    r = a.r
    messages = None
    if r.random() < 0.5:
        messages = []
        for _ in range(r.randint(0, 4)):
            m = {"role": r.choice(ROLES), "content": r.choice(CONTENTS)}
            if r.random() < 0.2:
                m[a.str()] = r.choice(CONTENTS)  # an extra key a template may read
            if r.random() < 0.1:
                del m["content"]
            messages.append(m)
    prompt = r.choice([None, a.str(), "hello"]) if messages is None else None
    input_ids = a.ids() if messages is None and prompt is None and r.random() < 0.8 else None
    return GenerateReq(a.rid(), a.reply_to(), a.params(), prompt=prompt, messages=messages, input_ids=input_ids,
                       do_preprocess=r.random() < 0.8, session_id=r.choice([None, 1, a.int()]),
                       sequence_start=r.choice([True, False, None]), priority=r.choice([0, a.int()]))


@pytest.fixture(scope="module")
def preprocessor(smollm2_dir):
    from conveyor.services.tokenizer.preprocess import Preprocessor

    return Preprocessor(smollm2_dir, 256)


def test_the_tokenizer_stage_refuses_adversarial_requests_with_400s(preprocessor) -> None:
    """The tokenizer loop turns ConveyorError into a 400 and anything else into a 500: here no
    request may raise anything but a ConveyorError, and what it passes on must encode."""
    in_codec, out_codec = Codec(TokenizerIn), Codec(EngineIn)
    a = Adversary(SEED, preprocessor.vocab_size, [f"r{i}" for i in range(8)], REPLY)
    accepted = refused = 0
    for _ in range(CASES):
        msg = _wire(in_codec, _tokenizer_message(a))
        if msg is None:
            continue
        try:
            out = preprocessor.prepare(msg)
        except ConveyorError:
            refused += 1
            continue
        assert out_codec.decode(out_codec.encode(out)) == out
        accepted += 1
    assert accepted and refused
    out = preprocessor.prepare(GenerateReq("normal", REPLY, SamplingParams(), messages=[{"role": "user",
                                                                                         "content": "hi"}]))
    assert out.token_ids and out.rid == "normal"


# ---- the detokenizer -------------------------------------------------------------------------------------

def _detokenizer_message(a: Adversary):
    r = a.r
    kind = r.choices(["admitted", "batch", "error", "report"], weights=[3, 6, 1, 1])[0]
    if kind == "admitted":
        return Admitted(a.rid(), a.reply_to(), r.choice([3, a.int()]), a.params().detokenize_params(), a.ids(),
                        history_tokens=r.choice([0, a.int()]))
    if kind == "error":
        return ErrorOut(a.rid(), r.choice([400, 503, a.int()]), a.str(), reply_to=a.reply_to())
    if kind == "report":
        return LoadReport(a.reply_to(), a.float(), stage_stats={a.str(): a.float()})
    n = r.randint(0, 4)
    column = lambda make: [make() for _ in range(n if r.random() < 0.9 else r.randint(0, 5))]
    want_lp = r.random() < 0.3
    return TokenBatch(column(a.rid),
                      column(lambda: r.choice([-1, r.randrange(a.ok_ids), a.int()])),
                      column(lambda: r.choice([-1, -1, -1, 0, 1, 2, 3, a.int()])),
                      column(lambda: r.choice([0, 2, a.int()])),
                      column(a.float) if want_lp else None,
                      column(lambda: [(r.choice([r.randrange(a.ok_ids), a.int()]), a.float())
                                      for _ in range(r.choice([0, 1, 2, 21]))]) if want_lp else None)


def test_the_detokenizer_stage_drops_adversarial_messages_whole(smollm2_dir, caplog) -> None:
    """The real stage loop over inproc sockets: afterwards a normal request's text is right, and
    nothing it passed to the ingress fails the ingress's checks."""
    from conveyor.services.detokenizer.batches import Detokenizer
    from conveyor.services.detokenizer.process import serve_detokenizer
    from conveyor.services.tokenizer.preprocess import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    ctx = zmq.Context()
    addresses = Addresses.inproc()
    reply = addresses.reply_endpoint().bind
    ingress, engine = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    ingress.bind(reply)
    engine.bind(addresses.engine_in.bind)  # takes the StopReqs the stage sends
    stop = threading.Event()
    thread = threading.Thread(target=serve_detokenizer, args=(ctx, addresses, Detokenizer(tokenizer), stop),
                              daemon=True)
    feed = ctx.socket(zmq.PUSH)
    in_codec, out_codec = Codec(DetokenizerIn), Codec(IngressIn)
    received: list = []
    try:
        with caplog.at_level(logging.WARNING):
            thread.start()
            feed.connect(addresses.detokenizer_in.connect)
            a = Adversary(SEED, len(tokenizer), [f"r{i}" for i in range(8)], reply)
            for _ in range(CASES):
                msg = _wire(in_codec, _detokenizer_message(a))
                if msg is not None:
                    in_codec.send(feed, msg)
            ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
            in_codec.send(feed, Admitted("normal", reply, 3, SamplingParams().detokenize_params(), [1, 2, 3]))
            # It ends on the end token, as the engine ends a turn: a STOP token is not text.
            ended = ids + [tokenizer.eos_token_id]
            in_codec.send(feed, TokenBatch(["normal"] * len(ended), ended, [-1] * len(ids) + [int(Finish.STOP)],
                                           [0] * len(ended)))
            deadline = time.monotonic() + 10
            while not any(isinstance(m, TextBatch) and "normal" in m.rids and max(m.finish) >= 0 for m in received):
                assert time.monotonic() < deadline, "the normal request was not answered"
                if ingress.poll(50):
                    received += out_codec.recv_all(ingress)
            assert thread.is_alive()
    finally:
        stop.set()
        thread.join(5)
        for s in (feed, ingress, engine):
            s.close(0)
        ctx.term()

    texts = [t for m in received if isinstance(m, TextBatch) for r, t in zip(m.rids, m.texts) if r == "normal"]
    assert "".join(texts) == tokenizer.decode(ids)
    for m in received:  # nothing malformed reached the ingress
        {TextBatch: check_text_batch, ErrorOut: check_error_out, Admitted: check_admitted}.get(
            type(m), lambda _: None)(m)
    # Every bad message was caught by the checks (a warning), none by the loop's last resort.
    assert "dropped a malformed message" in caplog.text
    assert "could not be applied" not in caplog.text

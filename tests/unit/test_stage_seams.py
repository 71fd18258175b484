"""The seams between stages, without a model: the codec, the engine service loop (driving the
model-free engine of conveyor/testing/fake_engine.py) and the engine client's admission protocol.

Every wait is a poll with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from conveyor.protocol import Abort, Addresses, Admitted, CancelSession, Codec, DetokenizerIn, EngineIn, \
    EngineStats, ErrorOut, Finish, GenerateReq, IngressGone, IngressIn, LoadReport, Ping, SamplingParams, SessionEnd, \
    StageStatus, StopReq, TextBatch, TokenBatch, TokenizedReq, TokenizerIn
from conveyor.services.engine.service import EngineService
from conveyor.services.engine_client import EngineClient, RequestError
from conveyor.testing.fake_engine import FakeEngine
from conveyor.testing.waiting import wait_until

DEADLINE = 10.0


# ---- codec ---------------------------------------------------------------------------------------

def test_every_message_round_trips_through_its_socket_union() -> None:
    params = SamplingParams(max_new_tokens=3, stop_words=["x"], bad_sequences=[[1, 2]], random_seed=7)
    cases = [
        (TokenizerIn, GenerateReq("r", "inproc://x", params, messages=[{"role": "user", "content": "hi"}],
                                  session_id=4, sequence_start=None)),
        (EngineIn, TokenizedReq("r", "inproc://x", [1, 2, 3], params, session_id=4, first_turn_ids=[9, 1, 2, 3])),
        (EngineIn, Abort("r")), (EngineIn, CancelSession(4)), (EngineIn, SessionEnd(4)), (EngineIn, StopReq("r")),
        (EngineIn, Ping("inproc://x", 1.5, {"a": 1.0})),
        (DetokenizerIn, Admitted("r", "inproc://x", 3, params.detokenize_params(), [2, 3], history_tokens=5)),
        (DetokenizerIn, TokenBatch(["r"], [5], [int(Finish.STOP)], [0], [-0.1], [[(5, -0.1)]])),
        (DetokenizerIn, LoadReport("inproc://x", 1.0, EngineStats(running=1, kv_usage=0.5))),
        (IngressIn, TextBatch(["r"], ["a"], [[5]], [-1], [3], [1], [0])),
        (IngressIn, ErrorOut("r", 400, "bad", param="top_p", code=None, reply_to="inproc://x")),
    ]
    for union, msg in cases:
        codec = Codec(union)
        assert codec.decode(codec.encode(msg)) == msg


def test_recv_all_drops_a_malformed_frame_and_keeps_the_rest() -> None:
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("inproc://codec-test")
        push.connect("inproc://codec-test")
        codec = Codec(EngineIn)
        push.send(codec.encode(Abort("a")))
        push.send(b"\xc1 not msgpack")  # 0xc1 is never valid msgpack
        push.send(msgspec.msgpack.encode(["wrong", "shape"]))
        push.send(codec.encode(StopReq("b")))
        got: list = []
        wait_until(lambda: got.extend(codec.recv_all(pull)) or len(got) >= 2, "two good frames", DEADLINE, every=0.002)
        assert got == [Abort("a"), StopReq("b")]
        pull.close(0)
        push.close(0)
    finally:
        ctx.term()


# ---- the engine service loop ---------------------------------------------------------------------

class _Ring:
    """An EngineService on a FakeEngine in a thread, with sockets standing in for its peers."""

    def __init__(self, engine: FakeEngine, **service_kw):
        self.ctx = zmq.Context()
        self.addresses = dataclasses.replace(Addresses.inproc(), launcher_token="launcher-secret")
        self.engine = engine
        self.out = self.ctx.socket(zmq.PULL)  # the detokenizer's side
        self.out.bind(self.addresses.detokenizer_in.bind)
        self.service = EngineService(engine, self.ctx, self.addresses, **service_kw)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,), daemon=True)
        self.thread.start()
        self.into = self.ctx.socket(zmq.PUSH)  # the tokenizer's / ingress's side
        self.into.connect(self.addresses.engine_in.connect)
        self.in_codec, self.out_codec = Codec(EngineIn), Codec(DetokenizerIn)
        self.received: list = []

    def send(self, msg) -> None:
        self.in_codec.send(self.into, msg)

    def until(self, predicate, what: str):
        """Collect output messages until ``predicate(received)`` holds."""
        def ready():
            self.received.extend(self.out_codec.recv_all(self.out))
            return predicate(self.received)
        return wait_until(ready, what, DEADLINE, every=0.002)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(DEADLINE)
        self.into.close(0)
        self.out.close(0)
        self.ctx.term()


@pytest.fixture
def ring():
    r = _Ring(FakeEngine([11, 12, 13], session_len=64, num_blocks=100))
    yield r
    r.close()


def _req(rid: str, n: int = 3, **kw) -> TokenizedReq:
    return TokenizedReq(rid, "inproc://ingress", [1, 2, 3, 4], SamplingParams(max_new_tokens=n), **kw)


def _finished(rid: str):
    return lambda got: any(isinstance(m, TokenBatch) and rid in m.rids and m.finish[m.rids.index(rid)] >= 0
                           for m in got)


def test_admission_comes_before_tokens_and_a_resend_runs_once(ring) -> None:
    ring.send(_req("a"))
    ring.send(_req("a"))  # the ingress resent it: admitted once
    ring.until(_finished("a"), "request a to finish")
    kinds = [type(m) for m in ring.received]
    assert kinds[0] is Admitted and kinds.count(Admitted) == 1
    adm = ring.received[0]
    assert (adm.rid, adm.reply_to, adm.num_prompt_tokens, adm.prompt_tail) == ("a", "inproc://ingress", 4, [1, 2, 3, 4])
    tokens = [t for m in ring.received if isinstance(m, TokenBatch) for r, t in zip(m.rids, m.tokens) if r == "a"]
    assert len(tokens) == 3
    assert ring.engine.stats().free_blocks == 100


def test_a_refusal_is_an_error_message_to_the_ingress(ring) -> None:
    ring.send(TokenizedReq("bad", "inproc://ingress", [1], SamplingParams(top_p=0.0)))
    ring.send(TokenizedReq("long", "inproc://ingress", list(range(80)), SamplingParams()))
    errors = ring.until(lambda got: [m for m in got if isinstance(m, ErrorOut)] if len(
        [m for m in got if isinstance(m, ErrorOut)]) == 2 else None, "two refusals")
    assert {(e.rid, e.status, e.param, e.reply_to) for e in errors} == {
        ("bad", 400, "top_p", "inproc://ingress"), ("long", 400, "messages", "inproc://ingress")}
    assert errors[[e.rid for e in errors].index("long")].code == "context_length_exceeded"
    assert not any(isinstance(m, Admitted) for m in ring.received)


def test_abort_stop_and_sessions_by_type(ring) -> None:
    ring.engine.step_delay = 0.01
    ring.send(_req("x", n=10_000))
    ring.send(_req("y", n=10_000))
    ring.send(_req("s", n=10_000, session_id=5))
    ring.until(lambda got: sum(isinstance(m, Admitted) for m in got) == 3, "three admissions")
    ring.send(Abort("x"))
    ring.send(StopReq("y"))
    ring.send(CancelSession(5))
    for rid, reason in (("x", Finish.ABORT), ("y", Finish.STOP), ("s", Finish.ABORT)):
        ring.until(_finished(rid), f"{rid} to finish")
        last = [m for m in ring.received if isinstance(m, TokenBatch) and rid in m.rids][-1]
        assert last.finish[last.rids.index(rid)] == reason
    # The session stays after a cancel: its next turn knows the history.
    ring.send(_req("s2", n=1, session_id=5))
    adm = ring.until(lambda got: next((m for m in got if isinstance(m, Admitted) and m.rid == "s2"), None), "s2")
    assert adm.history_tokens > 4
    ring.until(_finished("s2"), "s2 to finish")
    ring.send(SessionEnd(5))
    ring.send(_req("s3", n=1, session_id=5, first_turn_ids=[7, 7, 1, 2, 3, 4]))
    adm = ring.until(lambda got: next((m for m in got if isinstance(m, Admitted) and m.rid == "s3"), None), "s3")
    assert adm.history_tokens == 0 and adm.num_prompt_tokens == 6  # a new session: its first-turn rendering
    ring.until(_finished("s3"), "s3 to finish")
    assert ring.engine.stats().free_blocks == 100


def test_an_internal_failure_tells_the_client_only_the_request_id(ring, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("secret: /srv/models/internal-path")

    monkeypatch.setattr(ring.engine, "add_request", broken)
    ring.send(_req("boom"))
    err = ring.until(lambda got: next((m for m in got if isinstance(m, ErrorOut)), None), "the error")
    assert err.status == 500 and err.code == "internal_error" and err.reply_to == "inproc://ingress"
    assert "boom" in err.message and "secret" not in err.message


def test_ping_is_answered_with_the_engine_stats(ring) -> None:
    ring.send(Ping("inproc://ingress", 12.5, {"tokenizer_busy_s": 0.25}))
    report = ring.until(lambda got: next((m for m in got if isinstance(m, LoadReport)), None), "a LoadReport")
    assert report.reply_to == "inproc://ingress" and report.sent_at == 12.5
    assert report.engine.num_blocks == 100 and report.stage_stats["tokenizer_busy_s"] == 0.25
    assert "engine_busy_s" in report.stage_stats and report.stage_stats["engine_backlog"] == 0


def test_pings_report_requests_waiting_behind_a_long_step(ring) -> None:
    """The engine thread is held in one long call (as by a kernel compiling on first use): a
    request that arrives meanwhile counts in the backlog the input thread reports, until taken."""
    entered, release = threading.Event(), threading.Event()
    held = threading.Thread(target=ring.service.call, args=(lambda engine: entered.set() or release.wait(DEADLINE),),
                            daemon=True)
    held.start()
    assert entered.wait(DEADLINE)
    ring.send(_req("late"))

    def backlog(n: int):
        ring.received.clear()
        ring.send(Ping("inproc://ingress", 1.0))
        report = ring.until(lambda got: next((m for m in got if isinstance(m, LoadReport)), None), "a LoadReport")
        return report.stage_stats["engine_backlog"] == n

    wait_until(lambda: backlog(1), "the request in the backlog", DEADLINE, every=0.002)
    time.sleep(0.3)  # its wait for the step loop grows while the step runs
    ring.received.clear()
    ring.send(Ping("inproc://ingress", 1.0))
    report = ring.until(lambda got: next((m for m in got if isinstance(m, LoadReport)), None), "a LoadReport")
    assert report.stage_stats["engine_backlog_age_s"] >= 0.3
    release.set()
    ring.until(lambda got: any(isinstance(m, Admitted) and m.rid == "late" for m in got), "the admission")
    wait_until(lambda: backlog(0), "an empty backlog", DEADLINE, every=0.002)
    last = next(m for m in reversed(ring.received) if isinstance(m, LoadReport))
    assert last.stage_stats["engine_backlog_age_s"] == 0.0
    held.join(DEADLINE)


INGRESS_A, INGRESS_B = "inproc://conveyor-reply-a", "inproc://conveyor-reply-b"  # reply addresses, as made


def _running_of(ring, rids: set[str]) -> set[str]:
    """Which of ``rids`` have not finished in what the engine sent so far."""
    ring.received.extend(ring.out_codec.recv_all(ring.out))
    return {rid for rid in rids if not _finished(rid)(ring.received)}


def test_the_requests_of_an_ingress_that_went_silent_are_aborted() -> None:
    """An ingress that Pinged and then stopped (killed, or its host gone) has its requests
    aborted after ``orphan_after_s``; one that keeps Pinging keeps its requests running."""
    ring = _Ring(FakeEngine([11, 12, 13], session_len=1 << 20, num_blocks=100, step_delay=0.01), orphan_after_s=0.5)
    try:
        ring.send(Ping(INGRESS_A, 0.0))
        ring.send(Ping(INGRESS_B, 0.0))
        ring.send(TokenizedReq("a1", INGRESS_A, [1, 2], SamplingParams(max_new_tokens=10_000)))
        ring.send(TokenizedReq("b1", INGRESS_B, [1, 2], SamplingParams(max_new_tokens=10_000)))
        ring.until(lambda got: sum(isinstance(m, Admitted) for m in got) == 2, "two admissions")
        start = time.monotonic()
        while time.monotonic() - start < 1.5:  # B keeps beating, A is silent
            ring.send(Ping(INGRESS_B, 0.0))
            if "a1" not in _running_of(ring, {"a1"}):
                break
            time.sleep(0.05)
        ring.until(_finished("a1"), "a1 to be aborted")
        last = [m for m in ring.received if isinstance(m, TokenBatch) and "a1" in m.rids][-1]
        assert last.finish[last.rids.index("a1")] == Finish.ABORT
        assert _running_of(ring, {"b1"}) == {"b1"} and ring.service.orphans_aborted == 1
        # A client that never Pinged (a test, an in-process caller) is not judged.
        ring.send(TokenizedReq("c1", "inproc://conveyor-reply-c", [1, 2], SamplingParams(max_new_tokens=10_000)))
        ring.until(lambda got: any(isinstance(m, Admitted) and m.rid == "c1" for m in got), "c1 admitted")
        later = time.monotonic() + 20  # B is silent too by then; C never spoke
        ring.service.call(lambda engine: ring.service.abort_orphans(later))
        ring.until(_finished("b1"), "b1 to be aborted")
        assert _running_of(ring, {"c1"}) == {"c1"}
        ring.send(Abort("c1"))
        ring.until(_finished("c1"), "c1 to end")
        assert ring.engine.stats().free_blocks == 100
    finally:
        ring.close()


def test_the_launcher_saying_an_ingress_died_aborts_its_requests_at_once(ring) -> None:
    ring.engine.step_delay, ring.engine.session_len = 0.01, 1 << 20
    ring.send(TokenizedReq("a1", INGRESS_A, [1, 2], SamplingParams(max_new_tokens=10_000)))
    ring.send(TokenizedReq("b1", INGRESS_B, [1, 2], SamplingParams(max_new_tokens=10_000)))
    ring.until(lambda got: sum(isinstance(m, Admitted) for m in got) == 2, "two admissions")
    ring.send(IngressGone(INGRESS_A, "forged"))  # a peer without the launcher's token: ignored
    ring.send(IngressGone(INGRESS_B, "launcher-secret"))
    ring.until(_finished("b1"), "b1 to be aborted")
    assert _running_of(ring, {"a1"}) == {"a1"}
    ring.send(Abort("a1"))
    ring.until(_finished("a1"), "a1 to end")
    assert ring.engine.stats().free_blocks == 100


def test_engine_calls_run_between_steps(ring) -> None:
    assert ring.service.call(lambda engine: engine.stats().num_blocks) == 100
    with pytest.raises(ZeroDivisionError):
        ring.service.call(lambda engine: 1 / 0)


# ---- the engine client ---------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def _client_ring(with_tokenizer: bool = True, **client_kw):
    """A healthy EngineClient, with sockets standing in for the tokenizer (the feed it pushes
    to), the engine (where its aborts go) and the detokenizer (what it reads results from)."""
    ctx = zmq.asyncio.Context()
    addresses = dataclasses.replace(Addresses.inproc(), launcher_token="launcher-secret")
    engine_in = ctx.socket(zmq.PULL)
    engine_in.bind(addresses.engine_in.bind)
    client = EngineClient(addresses, "m", 64, ping_interval=0.02, admit_timeout=0.2, max_resends=1, context=ctx,
                          **client_kw)
    await client.start()
    feed = ctx.socket(zmq.PULL)
    if with_tokenizer:
        feed.connect(addresses.tokenizer_in.connect)
    results = ctx.socket(zmq.PUSH)
    results.connect(client.reply_to)
    out = Codec(IngressIn)

    async def reply(msg) -> None:
        await results.send(out.encode(msg))

    try:
        await reply(LoadReport(client.reply_to, 0.0))
        await asyncio.wait_for(_until(lambda: client.healthy), DEADLINE)
        yield client, feed, engine_in, reply
    finally:
        await client.close()
        for s in (feed, engine_in, results):
            s.close(0)
        ctx.term()


async def _recv(sock, codec: Codec, accept=lambda m: True, timeout: float = DEADLINE):
    async def loop():
        while True:
            msg = codec.decode(await sock.recv())
            if accept(msg):
                return msg
    return await asyncio.wait_for(loop(), timeout)


@pytest.mark.anyio
async def test_client_aborts_on_admission_when_its_consumer_left_early() -> None:
    async with _client_ring() as (client, feed, engine_in, reply):
        stream = client.generate(GenerateReq("r1", "", SamplingParams()))
        first = asyncio.ensure_future(stream.__anext__())
        req = await _recv(feed, Codec(TokenizerIn), lambda m: isinstance(m, GenerateReq))
        assert req.rid == "r1" and req.reply_to == client.reply_to
        first.cancel()  # the consumer leaves before the engine admitted the request
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        assert client.num_inflight == 0
        # Nothing can be aborted yet; the Admitted makes the client send the Abort.
        await reply(Admitted("r1", client.reply_to, 3, SamplingParams().detokenize_params()))
        abort = await _recv(engine_in, Codec(EngineIn), lambda m: isinstance(m, Abort))
        assert abort.rid == "r1"
        waiter = asyncio.ensure_future(client.wait_ended(["r1"]))
        await reply(TextBatch(["r1"], [""], [[]], [int(Finish.ABORT)], [3], [0], [0]))
        await asyncio.wait_for(waiter, DEADLINE)


@pytest.mark.anyio
async def test_client_resends_an_unadmitted_request_then_gives_up() -> None:
    async with _client_ring() as (client, feed, _, _):
        async def run():
            async for _ in client.generate(GenerateReq("r2", "", SamplingParams())):
                pass

        task = asyncio.ensure_future(run())
        codec = Codec(TokenizerIn)
        sent = [await _recv(feed, codec, lambda m: isinstance(m, GenerateReq)) for _ in range(2)]
        assert [m.rid for m in sent] == ["r2", "r2"]  # the first send and one resend
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(task, DEADLINE)
        assert err.value.status == 503 and client.num_inflight == 0


@pytest.mark.anyio
async def test_client_does_not_fail_a_request_while_the_engine_loop_is_stalled() -> None:
    """A request unadmitted past its resends while the engine's step loop has not taken its
    input for ``admit_timeout`` (one long step: a kernel compiling) is waiting, not lost: no
    503 until the loop moves again."""
    async with _client_ring() as (client, feed, _, reply):
        stalled = {"engine_backlog": 1.0, "engine_backlog_age_s": 5.0}
        await reply(LoadReport(client.reply_to, 0.0, stage_stats=stalled))
        await asyncio.wait_for(_until(lambda: client.load.stage_stats.get("engine_backlog_age_s") == 5.0), DEADLINE)

        async def run():
            async for _ in client.generate(GenerateReq("r4", "", SamplingParams())):
                pass

        task = asyncio.ensure_future(run())
        codec = Codec(TokenizerIn)
        sent = [await _recv(feed, codec, lambda m: isinstance(m, GenerateReq)) for _ in range(2)]
        assert [m.rid for m in sent] == ["r4", "r4"]  # sent, and resent (the engine admits an id once)
        await asyncio.sleep(1.0)  # without the stall: failed by 0.4 s
        assert not task.done()
        # The loop moved again and r4 was not admitted: lost.
        await reply(LoadReport(client.reply_to, 0.0, stage_stats={"engine_backlog": 0.0, "engine_backlog_age_s": 0.0}))
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(task, DEADLINE)
        assert err.value.status == 503


@pytest.mark.anyio
async def test_client_resends_a_lost_request_under_steady_traffic() -> None:
    """Requests keep arriving while each ~1 s step runs, so the engine always has some waiting
    (a young backlog): a request lost with a killed tokenizer worker is still resent after
    ``admit_timeout`` (before: only once the traffic stopped, a minute later)."""
    async with _client_ring() as (client, feed, _, reply):
        busy = {"engine_backlog": 3.0, "engine_backlog_age_s": 0.05}

        async def run():
            async for _ in client.generate(GenerateReq("r5", "", SamplingParams())):
                pass

        task = asyncio.ensure_future(run())
        codec = Codec(TokenizerIn)
        assert (await _recv(feed, codec, lambda m: isinstance(m, GenerateReq))).rid == "r5"  # lost with its worker

        async def keep_busy():
            while True:
                await reply(LoadReport(client.reply_to, 0.0, stage_stats=busy))
                await asyncio.sleep(client.ping_interval)

        beats = asyncio.ensure_future(keep_busy())
        try:
            assert (await _recv(feed, codec, lambda m: isinstance(m, GenerateReq), timeout=2.0)).rid == "r5"
        finally:
            beats.cancel()
            task.cancel()
            await asyncio.gather(beats, task, return_exceptions=True)


@pytest.mark.anyio
async def test_client_answers_503_at_once_when_no_tokenizer_takes_requests() -> None:
    async with _client_ring(with_tokenizer=False) as (client, _, _, _):
        with pytest.raises(RequestError) as err:  # before: the send waited for a worker forever
            await asyncio.wait_for(client.generate(GenerateReq("r3", "", SamplingParams())).__anext__(), 2.0)
        assert err.value.status == 503 and "tokenizer" in err.value.message and client.num_inflight == 0


@pytest.mark.anyio
async def test_client_stops_a_request_past_the_request_timeout() -> None:
    async with _client_ring(request_timeout=0.3) as (client, feed, engine_in, reply):
        async def run():
            async for _ in client.generate(GenerateReq("r4", "", SamplingParams())):
                pass

        task = asyncio.ensure_future(run())
        await _recv(feed, Codec(TokenizerIn), lambda m: isinstance(m, GenerateReq))
        # Admitted, then never a token.
        await reply(Admitted("r4", client.reply_to, 3, SamplingParams().detokenize_params()))
        with pytest.raises(RequestError) as err:
            await asyncio.wait_for(task, DEADLINE)
        assert err.value.status == 504 and err.value.code == "request_timeout"
        abort = await _recv(engine_in, Codec(EngineIn), lambda m: isinstance(m, Abort))
        assert abort.rid == "r4"  # the engine is told to stop it: its blocks come back


@pytest.mark.anyio
async def test_client_beats_to_the_engine_and_stays_healthy_without_tokenizers() -> None:
    """Pings go straight to the engine as well as round the ring: the engine hears this client
    (its heartbeat), and the client stays healthy (streams go on) while no tokenizer is up."""
    async with _client_ring(with_tokenizer=False) as (client, _, engine_in, reply):
        ping = await _recv(engine_in, Codec(EngineIn), lambda m: isinstance(m, Ping))
        assert ping.reply_to == client.reply_to
        for _ in range(3):  # the engine answers the direct pings; nothing goes round the ring
            await reply(LoadReport(client.reply_to, 0.0, stage_stats={"engine_steps": 1.0}))
            await asyncio.sleep(client.ping_interval)
        assert client.healthy


@pytest.mark.anyio
async def test_client_aborts_what_it_failed_and_what_it_does_not_know() -> None:
    async with _client_ring() as (client, feed, engine_in, reply):
        async def run(rid: str):
            async for _ in client.generate(GenerateReq(rid, "", SamplingParams())):
                pass

        tasks = [asyncio.ensure_future(run(rid)) for rid in ("f1", "f2")]
        for _ in tasks:
            await _recv(feed, Codec(TokenizerIn), lambda m: isinstance(m, GenerateReq))
        await reply(Admitted("f1", client.reply_to, 3, SamplingParams().detokenize_params()))
        await asyncio.wait_for(_until(lambda: client._requests["f1"].admitted), DEADLINE)
        client.fail_all("the detokenizer stage stopped")  # what a dead detokenizer's notice does
        for t in tasks:
            with pytest.raises(RequestError):
                await asyncio.wait_for(t, DEADLINE)
        codec = Codec(EngineIn)
        assert (await _recv(engine_in, codec, lambda m: isinstance(m, Abort))).rid == "f1"  # admitted: at once
        # Admitted after it failed here.
        await reply(Admitted("f2", client.reply_to, 3, SamplingParams().detokenize_params()))
        assert (await _recv(engine_in, codec, lambda m: isinstance(m, Abort))).rid == "f2"
        # Tokens of a request this client never sent (an earlier ingress at this address): aborted once.
        await reply(TextBatch(["old"], ["x"], [[5]], [-1], [3], [1], [0]))
        await reply(TextBatch(["old"], ["y"], [[6]], [-1], [3], [2], [0]))
        await reply(TextBatch(["done"], ["z"], [[7]], [int(Finish.STOP)], [3], [1], [0]))  # ended: nothing to do
        await reply(Admitted("marker", client.reply_to, 3, SamplingParams().detokenize_params()))
        aborts = []
        while not aborts or aborts[-1] != "marker":
            aborts.append((await _recv(engine_in, codec, lambda m: isinstance(m, Abort))).rid)
        assert aborts == ["old", "marker"]


@pytest.mark.anyio
async def test_client_ignores_a_stage_notice_without_the_launcher_token() -> None:
    async with _client_ring() as (client, _, _, reply):
        await reply(StageStatus("engine", False, 123, 0, "forged"))  # would pin /health at 503
        await reply(LoadReport(client.reply_to, 0.0))
        await asyncio.wait_for(_until(lambda: client.refused_notices == 1), DEADLINE)
        assert client.healthy and client.down == []


@pytest.mark.anyio
async def test_one_of_several_tokenizers_restarting_does_not_block_serving() -> None:
    """/health says 503 only while no request can be served: one of two tokenizer workers
    restarting leaves the other serving (before: 503, and a proxy dropped the node)."""
    async with _client_ring() as (client, _, _, reply):
        await reply(StageStatus("tokenizer-0", False, 11, 1, "launcher-secret", peers=2))
        await asyncio.wait_for(_until(lambda: client.down == ["tokenizer-0"]), DEADLINE)
        assert client.serving_blocked_by == [] and client.healthy
        await reply(StageStatus("tokenizer-1", False, 12, 1, "launcher-secret", peers=2))
        await asyncio.wait_for(_until(lambda: len(client.down) == 2), DEADLINE)
        assert client.serving_blocked_by == ["tokenizer-0", "tokenizer-1"]
        await reply(StageStatus("tokenizer-0", True, 13, 1, "launcher-secret", peers=2))
        await reply(StageStatus("detokenizer", False, 14, 1, "launcher-secret"))
        await asyncio.wait_for(_until(lambda: client.down == ["detokenizer", "tokenizer-1"]), DEADLINE)
        assert client.serving_blocked_by == ["detokenizer"] and not client.healthy


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_the_output_thread_ends_quietly_when_the_context_is_terminated(monkeypatch):
    """Shutting down terminates the ZeroMQ context while the engine's output thread may still
    hold a message: its send raises ContextTerminated, which ends the thread, not as an error."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_type))
    ctx = zmq.Context()
    service = EngineService(FakeEngine([11, 12, 13], session_len=64, num_blocks=100), ctx, Addresses.inproc())
    thread = threading.Thread(target=service._output_loop, daemon=True)
    thread.start()
    probe = ctx.socket(zmq.PAIR)  # raises ContextTerminated once term() has begun

    def terminating() -> bool:
        try:
            probe.poll(0)
        except zmq.ContextTerminated:
            return True
        return False

    term = threading.Thread(target=ctx.term, daemon=True)  # returns once every socket is closed
    term.start()
    wait_until(terminating, "the context to start terminating", DEADLINE, every=0.002)
    probe.close(0)
    service._outbox.put(LoadReport("ingress-0", 0.0))
    thread.join(DEADLINE)
    term.join(DEADLINE)
    assert not thread.is_alive() and not term.is_alive()
    assert errors == []

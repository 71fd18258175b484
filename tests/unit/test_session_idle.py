"""Idle sessions give their KV blocks back: the real LLMEngine on a tiny dummy-weight Llama on the
CPU, and the engine service loop that applies the timeout even when it has nothing to run.

Time is injected (``now``, the scheduler's clock), never slept.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import zmq

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.protocol import Addresses, Finish
from conveyor.protocol.sampling import SamplingParams
from conveyor.services.engine import service as engine_service
from conveyor.testing.fake_engine import FakeEngine
from conveyor.testing.waiting import wait_until

TIMEOUT = 600.0
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32",
)
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A config.json only: ``load_format='dummy'`` draws seeded weights, so every engine built
    from it computes the same tokens."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(load_format="dummy", device="cpu", cache_max_entry_count=32, block_size=4, max_batch_size=4,
               max_prefill_token_num=64, session_idle_timeout=TIMEOUT)
    return LLMEngine(model_dir, EngineConfig(**{**cfg, **overrides}))


def turn(engine: LLMEngine, ids: list[int], session_id: int) -> list[int]:
    """One turn of a session, stepped to its end; its tokens."""
    req = engine.add_request(ids, GREEDY, session_id=session_id)
    tokens, reasons = [], []
    while engine.has_work:
        for out in engine.step():
            assert out.request_id == req.request_id
            tokens += [] if out.token is None else [out.token]
            reasons += [] if out.finish_reason is None else [out.finish_reason]
    assert reasons == [Finish.LENGTH] and len(tokens) == GREEDY.max_new_tokens
    return tokens


def assert_idle_and_empty(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.parked and not engine.scheduler.parked_at
    assert not engine._sessions and not engine._seqs and not engine.has_work


FIRST, SECOND = [5, 17, 33, 2, 90, 41, 7, 64, 12, 3, 77], [8, 99, 23]


@pytest.mark.parametrize("overrides", [
    {},
    dict(enable_prefix_caching=True),  # the released blocks keep their hashes: the next turn may hit them
    dict(overlap_schedule=True),
], ids=["plain", "prefix_caching", "overlap"])
def test_an_idle_session_frees_its_blocks_and_its_next_turn_is_unchanged(model_dir, caplog, overrides):
    engine = make_engine(model_dir, **overrides)
    bm = engine.block_manager
    # The same two turns, with the session's KV kept between them.
    kept = turn(engine, FIRST, session_id=1) + turn(engine, SECOND, session_id=1)
    engine.end_session(1)
    assert_idle_and_empty(engine)

    first = turn(engine, FIRST, session_id=2)
    assert first == kept[:5]
    held = bm.num_blocks - bm.num_free_blocks
    assert held == 4  # 16 tokens computed, in blocks of 4
    parked_at = engine.scheduler.parked_at[2]
    assert engine.release_idle_sessions(now=parked_at + TIMEOUT - 0.5) == 0  # not idle long enough
    assert engine.release_idle_sessions() == 0  # now: just parked
    assert bm.num_free_blocks == bm.num_blocks - held
    with caplog.at_level(logging.INFO, logger="conveyor.engine.llm_engine"):
        assert engine.release_idle_sessions(now=parked_at + TIMEOUT) == 1
    assert bm.num_free_blocks == bm.num_blocks  # back to the baseline
    assert any("released the KV blocks of 1 session" in r.getMessage() for r in caplog.records)
    assert engine.release_idle_sessions(now=parked_at + 10 * TIMEOUT) == 0  # once only

    # The history stays as token ids: the next turn recomputes it and samples the same tokens.
    assert turn(engine, SECOND, session_id=2) == kept[5:]
    assert bm.num_free_blocks < bm.num_blocks  # parked again, with its blocks
    assert engine.release_idle_sessions(now=engine.scheduler.parked_at[2] + TIMEOUT) == 1
    engine.end_session(2)  # after a release: no error, nothing freed twice
    engine.end_session(2)
    assert_idle_and_empty(engine)


def test_only_sessions_idle_past_the_timeout_are_released(model_dir):
    engine = make_engine(model_dir)
    now = [1000.0]
    engine.scheduler.clock = lambda: now[0]
    bm = engine.block_manager
    turn(engine, FIRST, session_id=1)  # parks at 1000
    held1 = bm.num_blocks - bm.num_free_blocks
    now[0] = 1300.0
    turn(engine, SECOND, session_id=2)  # parks at 1300
    held2 = bm.num_blocks - bm.num_free_blocks - held1
    assert held1 and held2
    now[0] = 1000.0 + TIMEOUT  # session 1 idle for 600 s, session 2 for 300 s
    assert engine.release_idle_sessions() == 1
    assert list(engine.scheduler.parked) == [2] and len(engine.scheduler.parked[2].block_table) == held2
    assert bm.num_free_blocks == bm.num_blocks - held2
    now[0] = 1300.0 + TIMEOUT - 1
    assert engine.release_idle_sessions() == 0
    now[0] = 1300.0 + TIMEOUT
    assert engine.release_idle_sessions() == 1 and bm.num_free_blocks == bm.num_blocks
    for sid in (1, 2):
        engine.end_session(sid)
    assert_idle_and_empty(engine)


def test_a_session_checked_exactly_at_its_deadline_is_released(model_dir):
    """(t + 600) - t rounds to just below 600 for some clock readings t (this one was CI's): the
    deadline t + 600 must still count as idle for 600 s."""
    engine = make_engine(model_dir)
    parked = 3513.47000136
    assert (parked + TIMEOUT) - parked < TIMEOUT
    engine.scheduler.clock = lambda: parked
    turn(engine, FIRST, session_id=1)
    assert engine.release_idle_sessions(now=parked + TIMEOUT) == 1
    engine.end_session(1)
    assert_idle_and_empty(engine)


@pytest.mark.parametrize("timeout", [None, 0])
def test_no_timeout_keeps_idle_sessions(model_dir, timeout):
    engine = make_engine(model_dir, session_idle_timeout=timeout)
    turn(engine, FIRST, session_id=1)
    free = engine.block_manager.num_free_blocks
    assert engine.release_idle_sessions(now=time.monotonic() + 1e9) == 0
    assert engine.block_manager.num_free_blocks == free and list(engine.scheduler.parked) == [1]
    engine.end_session(1)
    assert_idle_and_empty(engine)


def test_the_fake_engine_has_nothing_to_release():
    engine = FakeEngine([11, 12], session_len=64, num_blocks=10)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), "a", session_id=4)
    while engine.has_work:
        engine.step()
    assert engine.release_idle_sessions() == 0 and engine.free_blocks == 10


# ---- the engine service loop ----------------------------------------------------------------------

class _CountingEngine(FakeEngine):
    """A FakeEngine that records when the service asks it to release idle sessions."""

    def __init__(self):
        super().__init__([11, 12, 13], session_len=64, num_blocks=100)
        self.release_calls: list[float] = []

    def release_idle_sessions(self) -> int:
        self.release_calls.append(time.perf_counter())
        return 0


def test_the_service_releases_idle_sessions_while_it_has_no_work(monkeypatch):
    every = 0.05  # instead of 1 s, so that several periods pass quickly
    monkeypatch.setattr(engine_service, "RELEASE_IDLE_EVERY_S", every)
    engine = _CountingEngine()
    ctx = zmq.Context()
    addresses = Addresses.inproc()
    out = ctx.socket(zmq.PULL)  # the detokenizer's side
    out.bind(addresses.detokenizer_in.bind)
    service = engine_service.EngineService(engine, ctx, addresses)
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(engine.release_calls) >= 4, "four release_idle_sessions calls", 10, every=0.002)
        assert not engine.has_work  # called from the idle loop, no step needed
        calls = engine.release_calls[:4]
        # At most once per period: the loop wakes every 0.2 s when idle, so the gaps are between
        # one period and one wake-up past it.
        assert all(b - a >= every * 0.99 for a, b in zip(calls, calls[1:]))
    finally:
        stop.set()
        thread.join(10)
        out.close(0)
        ctx.term()
    assert not thread.is_alive()
